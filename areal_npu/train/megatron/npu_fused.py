"""MindSpeed's fused NPU kernels where the engine's layers use them (the NPU branch only).

Each is the call MindSpeed ``core_r0.16.0`` (docker/versions.env ``MINDSPEED_COMMIT``) makes, taken
here without its command-line feature switches (the engine builds Megatron modules directly, not
through ``megatron.training`` arguments):

- RMSNorm: ``torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]``
  (``mindspeed/core/fusions/fused_rms_norm.py: RMSNorm.fused_rmsnorm``) -- :class:`FusedRMSNorm`,
  every norm of the local spec (:func:`areal_npu.train.megatron.specs.layer_spec`).
- SwiGLU: ``torch_npu.npu_swiglu(x, dim=-1)`` = ``silu(x[..., :n]) * x[..., n:]``
  (``mindspeed/core/fusions/fused_bias_swiglu.py: fused_swiglu``) -- :class:`FusedSwiGLU`, Megatron's
  MLP activation module (``use_te_activation_func``, the MLP's module slot for an activation).
- Packed Gated DeltaNet: ``mindspeed.core.ssm.chunk_gated_delta_rule.chunk_gated_delta_rule(q, k, v,
  g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=...)`` over the whole packed row (FLA's varlen
  signature; bf16/fp16 only: it refuses float32) -- :func:`packed_gdn_forward`, instead of one
  layer call per segment.
- Flash attention, layout TND: ``npu_fusion_attention`` in :mod:`areal_npu.kernels.packed_attention`.

Not wired: MindSpeed's fused rotary (``npu_rotary_mul``) replaces Transformer Engine's
``fused_apply_rotary_pos_emb`` inside Megatron only under its ``--use-fused-rotary-pos-emb``
switch; taking it here means patching a Megatron module global, left for a run on an NPU.
``torch_npu`` comes only through :func:`areal_npu.platform.import_torch_npu`; nothing here is
imported off the NPU branch.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

__all__ = [
    "MINDSPEED_GDN_MODULE",
    "FusedRMSNorm",
    "FusedSwiGLU",
    "causal_conv_in_segments",
    "fused_kernels",
    "gdn_rule",
    "packed_gdn_forward",
]

MINDSPEED_GDN_MODULE = "mindspeed.core.ssm.chunk_gated_delta_rule"
_HALF = (torch.bfloat16, torch.float16)


def fused_kernels() -> bool:
    """Whether this process runs on the NPU (MindSpeed's kernels are wired there only)."""
    from areal_npu.platform import current_platform

    return current_platform().device_type == "npu"


def _torch_npu():
    from areal_npu import platform

    return platform.import_torch_npu()


class FusedRMSNorm(torch.nn.Module):
    """``x / rms(x) * weight`` through ``npu_rms_norm`` (the weight named as torch's RMSNorm's)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _torch_npu().npu_rms_norm(x, self.weight, epsilon=self.eps)[0]


class FusedSwiGLU(torch.nn.Module):
    """Megatron's gated-linear-unit activation ``silu(x_glu) * x_linear`` (``[x_glu; x_linear]``
    halves of the last dim, as Megatron's MLP splits ``linear_fc1``'s output) through ``npu_swiglu``."""

    def __init__(self, config=None):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _torch_npu().npu_swiglu(x, dim=-1)


def gdn_rule(hidden: torch.Tensor):
    """MindSpeed's packed gated delta rule for these activations, or ``None`` (off the NPU, or in
    float32, which the kernel refuses: then the layer runs segment by segment in torch)."""
    if hidden.device.type != "npu" or hidden.dtype not in _HALF:
        return None
    return importlib.import_module(MINDSPEED_GDN_MODULE).chunk_gated_delta_rule


def causal_conv_in_segments(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of a packed row ``x [C, T]`` (``weight [C, K]``) that never reads across
    a segment boundary: ``out[:, t] = sum_i weight[:, i] * x[:, t - (K-1-i)]`` over taps inside
    ``t``'s segment (as ``F.conv1d`` with ``K-1`` zeros of left padding on each segment alone)."""
    k, t = weight.shape[-1], x.shape[-1]
    pos = torch.arange(t, device=x.device)
    start = cu[torch.searchsorted(cu[1:], pos, right=True)]  # first token of t's segment
    out = x * weight[:, k - 1 : k]
    for lag in range(1, k):
        shifted = F.pad(x[:, : t - lag], (lag, 0))
        inside = (pos - lag >= start).to(x.dtype)
        out = out + shifted * inside * weight[:, k - 1 - lag : k - lag]
    return out


def packed_gdn_forward(layer, hidden: torch.Tensor, cu: torch.Tensor, rule, params=None) -> torch.Tensor:
    """transformers' ``Qwen3_5GatedDeltaNet.forward`` (no cache) on one packed row ``hidden [1, T, H]``
    with every op segment-aware: the conv by :func:`causal_conv_in_segments`, the recurrence by the
    varlen ``rule`` (FLA's signature) with ``cu_seqlens``, the gated norm's RMSNorm by
    ``npu_rms_norm``; the other ops are per token. ``params``:
    tensors to use instead of ``layer``'s own (names as in ``layer.named_parameters()``)."""
    p = dict(layer.named_parameters())
    p.update(params or {})
    row, cu = hidden[0], cu.to(device=hidden.device, dtype=torch.long)
    qkv = causal_conv_in_segments(F.linear(row, p["in_proj_qkv.weight"]).T, p["conv1d.weight"].squeeze(1), cu)
    qkv = F.silu(qkv).T  # [T, conv_dim]
    value_dim = p["in_proj_z.weight"].shape[0]
    key_dim = (p["in_proj_qkv.weight"].shape[0] - value_dim) // 2
    query, key, value = torch.split(qkv, [key_dim, key_dim, value_dim], dim=-1)
    dk, dv, hv = layer.head_k_dim, layer.head_v_dim, p["A_log"].shape[0]
    query, key = (x.reshape(1, x.shape[0], -1, dk) for x in (query, key))
    value = value.reshape(1, value.shape[0], hv, dv)
    beta = F.linear(row, p["in_proj_b.weight"]).sigmoid()[None]
    a = F.linear(row, p["in_proj_a.weight"]).float()
    g = (-p["A_log"].float().exp() * F.softplus(a + p["dt_bias"]))[None]  # log decay, float32
    if hv // query.shape[2] > 1:
        query, key = (x.repeat_interleave(hv // x.shape[2], dim=2) for x in (query, key))
    core, _ = rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    z = F.linear(row, p["in_proj_z.weight"]).reshape(-1, dv)
    core = core.reshape(-1, dv)
    # the gated norm: rms-normalise and scale (fused), then gate by silu(z)
    normed = _torch_npu().npu_rms_norm(core, p["norm.weight"], epsilon=layer.layer_norm_epsilon)[0]
    out = (normed * F.silu(z.float())).to(core.dtype).reshape(1, row.shape[0], -1)
    return F.linear(out, p["out_proj.weight"])
