"""Third-party patches, one place per library, each with a why-comment and a test.

- :mod:`areal_npu.compat.transformers` -- transformers.
- :mod:`areal_npu.compat.vllm` -- vLLM: ``cpu`` (start-up hooks for the CPU build: torchvision
  operator schemas, the ``vllm`` distribution name), ``cpu_sampling`` / ``v023_cpu_sampling``
  (rejection-sampler kernels on the CPU), ``cpu_mamba`` (mamba-state copy kernels on the CPU),
  ``v023_gdn_state`` (Gated DeltaNet state dtype on 0.23), ``spec_off`` (no drafter work at k = 0).
"""
