"""Our packer's THD micro-batches as Megatron input: ``PackedSeqParams`` and this rank's tokens.

A :class:`areal_npu.data.packed_layout.PackedBatch` packed with ``alignment = tp`` (or
``2 * tp * cp``) and ``cp_size = cp`` already has what Megatron needs: every sample segment padded
*inside itself* to a multiple of ``2 * cp`` (tail tokens after the real ones, so causal attention
keeps them invisible), and a trailing padding segment of its own up to the alignment. Megatron's
convention (TE and its THD RoPE, ``rope_utils._apply_rotary_pos_emb_thd``) is that
``cu_seqlens_*_padded`` are the *global* boundaries of the padded segments while each CP rank holds
only its zigzag share of the tokens; RoPE and attention derive the local positions from them. Our
attention ignores padding by construction, so ``cu_seqlens_q`` (real lengths, TE's way of
skipping the pad) is the padded list too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_npu.data.context_parallel import cp_split
from areal_npu.data.packed_layout import PackedBatch

__all__ = ["MegatronMicroBatch", "packed_seq_params", "to_megatron"]


def packed_seq_params(batch: PackedBatch, device=None, cp_group=None):
    """Megatron's ``PackedSeqParams`` (``qkv_format="thd"``) for ``batch`` (global boundaries)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.cu_seqlens.to(device=device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=int(batch.max_seqlen),
        max_seqlen_kv=int(batch.max_seqlen),
        cp_group=cp_group,
    )


@dataclass
class MegatronMicroBatch:
    """One packed micro-batch as this rank feeds it to the model: its zigzag share of every
    per-token tensor (``fields``) and the global ``PackedSeqParams``."""

    batch: PackedBatch
    params: object  # PackedSeqParams
    input_ids: torch.Tensor  # [t]
    position_ids: torch.Tensor  # [t]
    fields: dict[str, torch.Tensor]  # [t] each
    cp_size: int
    cp_rank: int


def to_megatron(
    batch: PackedBatch,
    fields: dict[str, torch.Tensor],
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_group=None,
    device=None,
) -> MegatronMicroBatch:
    """Split ``batch`` and its packed per-token ``fields`` for CP rank ``cp_rank`` (zigzag)."""
    expected = 2 * cp_size if cp_size > 1 else 1
    seg = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    bad = [s for s in seg if s % expected]
    if bad:
        raise ValueError(
            f"segments of {bad} tokens: with cp_size={cp_size} every segment must be a multiple of "
            f"{expected}; pack with cp_size={cp_size} and alignment a multiple of {expected}"
        )
    cu = batch.cu_seqlens

    def split(t: torch.Tensor) -> torch.Tensor:
        return cp_split(t, cu, cp_size, cp_rank).to(device)

    return MegatronMicroBatch(
        batch=batch,
        params=packed_seq_params(batch, device, cp_group),
        input_ids=split(batch.input_ids),
        position_ids=split(batch.position_ids),
        fields={k: split(v) for k, v in fields.items()},
        cp_size=cp_size,
        cp_rank=cp_rank,
    )


def check_same_samples(samples, group) -> None:
    """The TP x CP ranks of one model replica (``group``) must hold the same batch (a cheap
    fingerprint: count, tokens, sum of ids), or their collectives would mix different batches."""
    import torch.distributed as dist

    from areal_npu.train.dist import reduce_floats

    if dist.get_world_size(group) == 1:
        return
    ids_sum = sum(int(s.input_ids.sum()) for s in samples)
    mine = [float(len(samples)), float(sum(len(s) for s in samples)), float(ids_sum)]
    hi = reduce_floats(mine, dist.ReduceOp.MAX, group)
    lo = [-x for x in reduce_floats([-x for x in mine], dist.ReduceOp.MAX, group)]
    if hi != lo:
        raise ValueError(
            "the tensor/context-parallel ranks of one replica were given different samples; "
            "give every rank of a TP x CP group its data-parallel rank's share"
        )
