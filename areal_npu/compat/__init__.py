"""Third-party patches, one place per library, each with a why-comment and a test.

The bottom of the package: compat imports nothing of areal_npu outside itself (not even inside a
function), so every layer may use it and a patch never drags project code into vLLM's processes.

- :mod:`areal_npu.compat.transformers` -- transformers.
- :mod:`areal_npu.compat.megatron` -- Megatron-Core on the CPU.
- :mod:`areal_npu.compat.vllm` -- vLLM: ``features`` (which vLLM is installed and what it offers),
  ``cpu`` (start-up hooks for the CPU build: torchvision operator schemas, the ``vllm``
  distribution name), ``cpu_sampling`` / ``v023_cpu_sampling`` / ``cpu_expand`` (rejection-sampler
  kernels on the CPU), ``cpu_mamba`` (mamba-state copy kernels on the CPU), ``v023_gdn_state``
  (Gated DeltaNet state dtype on 0.23), ``spec_off`` (no drafter work at k = 0).
"""
