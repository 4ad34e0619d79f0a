"""Causal attention over packed (THD) sequences, one entry point for NPU, CUDA and CPU.

For every segment ``j`` (tokens ``[cu[j], cu[j+1])``) and query head ``h`` with kv head
``g = h // (Hq / Hkv)`` (GQA):

    out[t, h] = sum_{u in seg(t), u <= t} softmax_u(scale * q[t, h] . k[u, g]) v[u, g],
    scale = 1 / sqrt(d) unless given.

Segments never see each other. Shapes: q ``[T, Hq, d]``, k / v ``[T, Hkv, d]``, cu_seqlens int
``[S + 1]`` with a leading 0 and ``cu[-1] == T``.

- NPU: ``torch_npu.npu_fusion_attention`` with layout ``TND``, ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` as host lists of cumulative end offsets without the leading 0,
  ``sparse_mode=3`` and one cached 2048x2048 bool mask ``triu(ones, 1)`` (True = masked). At most
  1024 segments per call: longer lists are cut into several calls.
- CUDA, half precision: by layout (:mod:`areal_npu.kernels.attention_dispatch`, fitted to H200
  measurements): few long segments take one SDPA call per segment (the reference below), which
  beats varlen there; otherwise one varlen call:
  flash-attn's ``flash_attn_varlen_func`` when installed, else PyTorch's
  own varlen kernel ``torch.nn.attention.varlen.varlen_attn`` (causal = ``window_size=(-1, 0)``).
  Neither materialises repeated KV heads: flash-attn and torch >= 2.13 take GQA natively
  (``enable_gqa``); on older torch the query heads are split into ``Hq / Hkv`` strided groups
  (query heads ``j, j + r, j + 2r, ...`` map one-to-one onto the KV heads) and each group is one
  MHA varlen call over the same K/V. float32/float64 inputs (references, tests) take the exact
  path below: the varlen kernels are half precision only.
- CPU: exact, one segment at a time through SDPA: peak memory ``max_j s_j**2``, total work
  ``sum_j s_j**2``, never ``T**2``.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from areal_npu.kernels.attention_dispatch import PER_SEGMENT, cuda_attention_path

__all__ = [
    "NPU_MAX_HEAD_DIM",
    "NPU_MAX_HEADS",
    "NPU_MAX_SEGMENTS_PER_CALL",
    "cuda_native_gqa",
    "cuda_path_for",
    "cuda_varlen_attention",
    "npu_causal_mask",
    "packed_attention",
    "packed_attention_reference",
    "varlen_causal_attention",
]

NPU_MAX_SEGMENTS_PER_CALL = 1024
NPU_MAX_HEAD_DIM = 768
NPU_MAX_HEADS = 256
NPU_MASK_SIZE = 2048
NPU_SPARSE_MODE_CAUSAL = 3  # "down-right aligned" causal, compressed mask

_NPU_MASKS: dict[torch.device, torch.Tensor] = {}


def npu_causal_mask(device: torch.device | str) -> torch.Tensor:
    """The one compressed causal mask sparse_mode 3 needs, built once per device."""
    device = torch.device(device)
    if device not in _NPU_MASKS:
        ones = torch.ones(NPU_MASK_SIZE, NPU_MASK_SIZE, dtype=torch.bool, device=device)
        _NPU_MASKS[device] = torch.triu(ones, diagonal=1)
    return _NPU_MASKS[device]


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [T, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v token counts differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"incompatible k/v heads or head dims: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be an integer multiple of kv heads ({k.shape[1]})")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be 1-D with a leading 0 and at least one segment")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={q.shape[0]}, got {cu_seqlens.tolist()}")


def packed_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Exact causal packed attention, one segment at a time (the CPU path and test oracle)."""
    _check_shapes(q, k, v, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cu = cu_seqlens.tolist()
    outs = []  # concatenated once: slice-assignment would cost O(T) per segment in backward
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, s, d]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _validate_npu(q: torch.Tensor, k: torch.Tensor) -> None:
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if not 1 <= hq <= NPU_MAX_HEADS:
        raise ValueError(f"npu_fusion_attention supports 1..{NPU_MAX_HEADS} query heads, got {hq}")
    if d > NPU_MAX_HEAD_DIM:
        raise ValueError(f"npu_fusion_attention supports head_dim <= {NPU_MAX_HEAD_DIM}, got {d}")
    if hkv < 1 or hq % hkv:
        raise ValueError(
            f"npu_fusion_attention needs query heads ({hq}) to be a multiple of kv heads ({hkv})"
        )


def _npu_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    _validate_npu(q, k)
    from areal_npu import platform  # the device seam is the only place that imports torch_npu

    torch_npu = platform.import_torch_npu()
    mask = npu_causal_mask(q.device)
    ends = [int(x) for x in cu_seqlens[1:].tolist()]  # host list, one sync per call
    outs = []
    start_seg, start_tok = 0, 0
    while start_seg < len(ends):
        group = ends[start_seg : start_seg + NPU_MAX_SEGMENTS_PER_CALL]
        end_tok = group[-1]
        offsets = [e - start_tok for e in group]
        out = torch_npu.npu_fusion_attention(
            q[start_tok:end_tok],
            k[start_tok:end_tok],
            v[start_tok:end_tok],
            q.shape[1],
            pse=None,
            padding_mask=None,
            atten_mask=mask,
            scale=scale,
            keep_prob=1.0,
            input_layout="TND",
            actual_seq_qlen=offsets,
            actual_seq_kvlen=list(offsets),
            sparse_mode=NPU_SPARSE_MODE_CAUSAL,
        )[0]
        outs.append(out)
        start_seg += len(group)
        start_tok = end_tok
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _torch_varlen_attn():
    """PyTorch's varlen attention (torch >= 2.10) and whether it takes ``enable_gqa`` (>= 2.13)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_causal_attention(
    varlen_attn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    scale: float,
    native_gqa: bool,
) -> torch.Tensor:
    """Causal packed attention through a varlen kernel with PyTorch's ``varlen_attn`` signature.

    Without native GQA, query head ``h`` reads KV head ``h // r`` (``r = Hq / Hkv``); the query
    heads ``{g * r + j}`` for a fixed ``j`` therefore pair one-to-one with the KV heads, so ``r``
    MHA calls over the unrepeated K/V cover every head.
    """
    hq, hkv = q.shape[1], k.shape[1]
    call = functools.partial(
        varlen_attn,
        cu_seq_q=cu,
        cu_seq_k=cu,
        max_q=max_seqlen,
        max_k=max_seqlen,
        scale=scale,
        window_size=(-1, 0),
    )
    if hq == hkv:
        return call(q, k, v)
    if native_gqa:
        return call(q, k, v, enable_gqa=True)
    r = hq // hkv
    grouped = q.view(q.shape[0], hkv, r, q.shape[2])
    outs = [call(grouped[:, :, j].contiguous(), k, v) for j in range(r)]
    return torch.stack(outs, dim=2).view(q.shape[0], hq, v.shape[2])


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def cuda_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """The CUDA varlen path alone (flash-attn, else torch's ``varlen_attn``), whatever the layout."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max())
    flash_attn_varlen_func = _flash_attn_varlen()
    if flash_attn_varlen_func is not None:
        return flash_attn_varlen_func(
            q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True
        )
    varlen_attn, native_gqa = _torch_varlen_attn()
    if varlen_attn is None:
        raise RuntimeError(
            "packed attention on CUDA needs flash-attn or torch >= 2.10 (torch.nn.attention.varlen); "
            f"this is torch {torch.__version__}"
        )
    return varlen_causal_attention(varlen_attn, q, k, v, cu, max_seqlen, scale, native_gqa)


def cuda_native_gqa() -> bool:
    """Whether the installed varlen kernel takes GQA in one call (flash-attn, torch >= 2.13)."""
    return _flash_attn_varlen() is not None or _torch_varlen_attn()[1]


def cuda_path_for(lengths: list[int], q_heads: int, kv_heads: int, head_dim: int) -> str:
    """The CUDA path for this layout with the varlen kernel installed here."""
    return cuda_attention_path(lengths, q_heads, kv_heads, head_dim, cuda_native_gqa())


def _cuda_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int | None,
) -> torch.Tensor:
    if q.dtype not in (torch.float16, torch.bfloat16):
        return packed_attention_reference(q, k, v, cu_seqlens, scale)
    bounds = cu_seqlens.tolist()  # host copy of S + 1 ints: the layout the dispatch reads
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if cuda_path_for(lengths, q.shape[1], k.shape[1], q.shape[2]) == PER_SEGMENT:
        return packed_attention_reference(q, k, v, cu_seqlens, scale)
    return cuda_varlen_attention(q, k, v, cu_seqlens, scale, max_seqlen or max(lengths))


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention within each packed segment; returns ``[T, Hq, d]``.

    ``backend`` is ``"npu"``, ``"cuda"`` or ``"cpu"``; by default the device type of ``q``.
    """
    _check_shapes(q, k, v, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    backend = backend or q.device.type
    if backend == "npu":
        return _npu_packed_attention(q, k, v, cu_seqlens, scale)
    if backend == "cuda":
        return _cuda_packed_attention(q, k, v, cu_seqlens, scale, max_seqlen)
    if backend == "cpu":
        return packed_attention_reference(q, k, v, cu_seqlens, scale)
    raise ValueError(f"unknown packed attention backend {backend!r} (expected 'npu', 'cuda' or 'cpu')")
