"""Speculative decoding: its config, what it costs, what it buys, and the draft length a run uses.

* ``config``     -- :class:`SpecConfig` (``rollout.spec``): method, k, drafter; the adaptive policy's
  settings resolved once, typed; the draft length an engine starts with (``k_at_start``)
* ``planner``    -- step-time model (Amdahl over the step's phases) and accepted-length formulas
* ``cost``       -- per-step cost of drafting and verifying, calibrated from measurements; the k sweep
* ``step_plan``  -- the step model as a :class:`Plan` from a run's metrics or given numbers (what
  ``areal-npu plan``, :mod:`areal_npu.plan`, and the dry run's step-time prediction print)
* ``policy``     -- adaptive draft length: pure decision rules on measured acceptance and tokens/s
* ``adaptive``   -- the trainer-side driver: one step's metrics in, the engines' draft length out
* ``k_driver``   -- the engine side: a control file the server writes and vLLM's scheduler reads
* ``acceptance`` -- acceptance metrics as per-step deltas of the engines' counters
* ``context``    -- the context-length buckets (edges in one place) and acceptance per bucket and
  draft position, from the samples' per-request statistics
* ``context_k``  -- context-aware draft length: one k per bucket on the cost model (``adapt.by_context``)

Speculation sits below rollout: it imports nothing of :mod:`areal_npu.rollout`; what depends on the
device or the installed vLLM is checked by ``RolloutConfig.validate``. The vLLM patches speculation
needs live in :mod:`areal_npu.compat.vllm` (``spec_off``); metric keys and phase names in
:mod:`areal_npu.names`. Importing this package is cheap (no torch, no vLLM).
"""
