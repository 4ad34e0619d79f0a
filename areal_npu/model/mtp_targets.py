"""MTP inputs, labels and loss masks for every depth, rolled inside each packed segment.

For a token row ``ids`` (packed: segments from ``cu_seqlens``; padded: one segment per row) and
depth d = 1..D, at index t of segment ``[a, b)``:

    embed_ids[d-1, t] = ids[t + d]                    if t + d < b   else pad_id
    labels[d-1, t]    = ids[t + 1 + d]                if mask[d-1, t] else ignore_index
    mask[d-1, t]      = t + 1 + d < b  and valid[t + 1 + d]  and loss_mask[t + 1 + d]

``valid`` is False on padding (the alignment segment, CP tail padding, right padding of a padded
row); ``loss_mask`` marks the tokens that carry loss, over the *same* prompt + response ids as the
policy's (e.g. response tokens only). Nothing is ever rolled across a segment boundary or out of
padding: the roll is Megatron's ``roll_tensor(..., packed_seq_params)``, zero-filled at each end.
With context parallelism, build on the full packed row and split with
:func:`split_mtp_targets_for_cp` -- the same zigzag index set as the input ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from areal_npu.data.context_parallel import cp_split
from areal_npu.data.packed_layout import PackedBatch, pack_per_token

__all__ = [
    "MTPTargets",
    "build_mtp_targets",
    "build_packed_mtp_targets",
    "roll_in_segments",
    "split_mtp_targets_for_cp",
]


@dataclass
class MTPTargets:
    """Per-depth tensors shaped ``[D, *tokens]`` (tokens: ``[T]`` packed or ``[B, T]`` padded)."""

    embed_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor

    @property
    def num_depths(self) -> int:
        return int(self.labels.shape[0])

    def valid_counts(self) -> list[int]:
        """Tokens carrying loss at each depth (sum these over micro-batches / ranks for a global
        normaliser to pass to :func:`areal_npu.model.mtp_loss.mtp_loss`)."""
        return [int(m.sum()) for m in self.mask]


def _segment_end(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """``end[t]`` = the exclusive end of t's segment."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={total}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[1:], lengths)


def roll_in_segments(x: torch.Tensor, cu_seqlens: torch.Tensor, shift: int, fill=0) -> torch.Tensor:
    """``out[t] = x[t + shift]`` when ``t + shift`` lies in t's segment, else ``fill`` (dim 0 = T)."""
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    total = x.shape[0]
    end = _segment_end(cu_seqlens, total, x.device)
    src = torch.arange(total, device=x.device) + shift
    inside = src < end
    out = x.new_full(x.shape, fill)
    out[inside] = x[src[inside]]
    return out


def _build_1d(ids, cu, num_depths, loss_mask, valid, pad_id, ignore_index) -> MTPTargets:
    carries = valid & loss_mask
    embed_ids, labels, masks = [], [], []
    for d in range(1, num_depths + 1):
        embed_ids.append(roll_in_segments(ids, cu, d, pad_id))
        m = roll_in_segments(carries, cu, d + 1, False)
        masks.append(m)
        labels.append(torch.where(m, roll_in_segments(ids, cu, d + 1, 0), ignore_index))
    return MTPTargets(torch.stack(embed_ids), torch.stack(labels), torch.stack(masks))


def build_mtp_targets(
    input_ids: torch.Tensor,
    num_depths: int,
    cu_seqlens: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    valid_mask: torch.Tensor | None = None,
    pad_id: int = 0,
    ignore_index: int = -100,
) -> MTPTargets:
    """MTP ``embed_ids`` / ``labels`` / ``mask`` (see the module docstring).

    ``input_ids`` ``[T]`` with ``cu_seqlens`` (packed), or ``[B, T]`` without (one segment per row;
    ``valid_mask`` marks the real, right-padded tokens). ``loss_mask`` / ``valid_mask`` default to
    all True and have ``input_ids``' shape.
    """
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    ones = torch.ones_like(input_ids, dtype=torch.bool)
    loss_mask = ones if loss_mask is None else loss_mask.to(torch.bool)
    valid_mask = ones if valid_mask is None else valid_mask.to(torch.bool)
    for name, t in (("loss_mask", loss_mask), ("valid_mask", valid_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, input_ids {tuple(input_ids.shape)}")
    if input_ids.dim() == 1:
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, input_ids.shape[0]])
        return _build_1d(input_ids, cu_seqlens, num_depths, loss_mask, valid_mask, pad_id, ignore_index)
    if input_ids.dim() != 2 or cu_seqlens is not None:
        raise ValueError("pass a packed row [T] with cu_seqlens, or a padded batch [B, T] without")
    rows, width = input_ids.shape
    cu = torch.arange(0, (rows + 1) * width, width)
    flat = _build_1d(
        input_ids.reshape(-1),
        cu,
        num_depths,
        loss_mask.reshape(-1),
        valid_mask.reshape(-1),
        pad_id,
        ignore_index,
    )
    shape = (num_depths, rows, width)
    return MTPTargets(flat.embed_ids.view(shape), flat.labels.view(shape), flat.mask.view(shape))


def build_packed_mtp_targets(
    batch: PackedBatch,
    num_depths: int,
    loss_masks: Sequence[torch.Tensor] | None = None,
    pad_id: int = 0,
    ignore_index: int = -100,
) -> MTPTargets:
    """Targets for a :class:`~areal_npu.data.packed_layout.PackedBatch`; ``loss_masks[j]`` covers
    sample segment j's real tokens (prompt + response ids), as for the policy loss."""
    loss_mask = None
    if loss_masks is not None:
        loss_mask = pack_per_token([m.to(torch.bool) for m in loss_masks], batch, False)
    return build_mtp_targets(
        batch.input_ids, num_depths, batch.cu_seqlens, loss_mask, batch.valid_mask, pad_id, ignore_index
    )


def split_mtp_targets_for_cp(
    targets: MTPTargets, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int
) -> MTPTargets:
    """Rank ``cp_rank``'s share: the zigzag split of the input ids applied to every depth."""

    def split(t: torch.Tensor) -> torch.Tensor:
        return cp_split(t.transpose(0, 1), cu_seqlens, cp_size, cp_rank).transpose(0, 1).contiguous()

    return MTPTargets(split(targets.embed_ids), split(targets.labels), split(targets.mask))
