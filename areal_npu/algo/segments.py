"""Per-sequence reductions on packed (THD) token tensors.

A packed batch lays B sequences end to end in one token axis of length T. Sequence membership is
given either by ``cu_seqlens`` (int, shape [B + 1], ``cu_seqlens[0] == 0``, non-decreasing) or by a
segment-id tensor of the token shape whose entries are in ``[0, B)``; a negative id marks a token
that belongs to no sequence (trailing padding) and is ignored by every reduction here.

Padded [B, L] batches fit the same functions with ``segment_ids = arange(B)[:, None].expand(B, L)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def segment_ids_from_cu_seqlens(cu_seqlens: Tensor, total_tokens: int | None = None) -> Tensor:
    """Segment id of every token: ``seg[t] = b`` for ``cu_seqlens[b] <= t < cu_seqlens[b + 1]``.

    Tokens at or beyond ``cu_seqlens[-1]`` (when ``total_tokens`` is larger) get id -1.
    """
    cu = cu_seqlens.to(torch.long)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError("cu_seqlens must be 1-D and start at 0")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    num_segments = lengths.numel()
    seg = torch.repeat_interleave(torch.arange(num_segments, device=cu.device), lengths)
    total = int(cu[-1]) if total_tokens is None else int(total_tokens)
    if total < seg.numel():
        raise ValueError(f"total_tokens={total} is smaller than cu_seqlens[-1]={seg.numel()}")
    if total > seg.numel():
        pad = torch.full((total - seg.numel(),), -1, dtype=torch.long, device=cu.device)
        seg = torch.cat([seg, pad])
    return seg


def resolve_segment_ids(
    like: Tensor, segment_ids: Tensor | None = None, cu_seqlens: Tensor | None = None
) -> tuple[Tensor, int]:
    """Return ``(segment_ids, num_segments)`` shaped like ``like`` from either description."""
    if (segment_ids is None) == (cu_seqlens is None):
        raise ValueError("pass exactly one of segment_ids or cu_seqlens")
    if cu_seqlens is not None:
        if like.dim() != 1:
            raise ValueError("cu_seqlens needs a 1-D (packed) token tensor; pass segment_ids otherwise")
        return segment_ids_from_cu_seqlens(cu_seqlens, like.numel()).to(like.device), cu_seqlens.numel() - 1
    if segment_ids.shape != like.shape:
        raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} != token shape {tuple(like.shape)}")
    seg = segment_ids.to(torch.long)
    num_segments = int(seg.max()) + 1 if seg.numel() > 0 else 0
    return seg, max(num_segments, 0)


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int, mask: Tensor | None = None) -> Tensor:
    """``out[b] = Σ_{t: seg[t] = b, mask[t]} values[t]``; differentiable in ``values``."""
    valid = segment_ids >= 0
    if mask is not None:
        valid = valid & mask.to(torch.bool)
    vals = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    idx = torch.where(valid, segment_ids, torch.zeros_like(segment_ids))
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add(0, idx.reshape(-1), vals.reshape(-1))


def segment_count(segment_ids: Tensor, num_segments: int, mask: Tensor | None = None) -> Tensor:
    """Number of (masked-in) tokens per segment, as int64 [num_segments]."""
    ones = torch.ones(segment_ids.shape, dtype=torch.long, device=segment_ids.device)
    return segment_sum(ones, segment_ids, num_segments, mask)


def segment_mean(
    values: Tensor, segment_ids: Tensor, num_segments: int, mask: Tensor | None = None
) -> Tensor:
    """Mean over each segment's masked-in tokens; 0 for a segment with none."""
    total = segment_sum(values, segment_ids, num_segments, mask)
    count = segment_count(segment_ids, num_segments, mask).to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def broadcast_to_tokens(per_segment: Tensor, segment_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """``out[t] = per_segment[seg[t]]`` where ``mask[t]`` (and ``seg[t] >= 0``), else 0."""
    valid = segment_ids >= 0
    if mask is not None:
        valid = valid & mask.to(torch.bool)
    idx = torch.where(valid, segment_ids, torch.zeros_like(segment_ids))
    gathered = per_segment[idx]
    return torch.where(valid, gathered, torch.zeros((), dtype=gathered.dtype, device=gathered.device))
