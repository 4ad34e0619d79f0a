"""Speculative decoding: what it costs, what it buys, and the draft length a run uses.

* ``planner``    -- step-time model (Amdahl over the step's phases) and accepted-length formulas
* ``cost``       -- per-step cost of drafting and verifying, calibrated from measurements; the k sweep
* ``policy``     -- adaptive draft length: pure decision rules on measured acceptance and tokens/s
* ``adaptive``   -- the trainer-side driver: one step's metrics in, the engines' draft length out
* ``k_driver``   -- the engine side: a control file the server writes and vLLM's scheduler reads
* ``acceptance`` -- acceptance metrics as per-step deltas of the engines' counters
* ``plan_cli``   -- ``areal-npu plan``

The vLLM patches speculation needs live in :mod:`areal_npu.compat.vllm` (``spec_off``); metric keys
and phase names in :mod:`areal_npu.names`. Importing this package is cheap (no torch, no vLLM).
"""
