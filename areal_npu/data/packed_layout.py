"""THD layout of one packed micro-batch.

Sequences ``x_0 .. x_{n-1}`` (lengths ``s_i``) become one token row of length ``T``:

- ``tokens = concat(x_0, .., x_{n-1}, pad)``;
- ``cu_seqlens = [0, s_0, s_0 + s_1, .., T]`` (int32, leading 0), one entry per segment;
- ``position_ids[t] = t - cu_seqlens[j]`` for ``t`` in segment ``j`` (restarts at 0);
- ``max_seqlen = max_j (cu_seqlens[j+1] - cu_seqlens[j])``.

Alignment: ``T`` is rounded up to a multiple of ``alignment`` (``tp``, or ``2 * tp * cp``) by a
padding *segment of its own*, never by masked rows, so no query row is fully masked (Ascend's fused
attention rejects those) and no real token sees a pad. With context parallelism every sequence
must also split into ``2 * cp`` equal chunks, so each sequence gets ``(-s_i) mod 2cp`` tail tokens
inside its own segment: they come after every real token of that segment, so causal attention keeps
them invisible to it; ``valid_mask`` is False on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from areal_npu.data.packing import restore_order

__all__ = [
    "PackedBatch",
    "cu_seqlens_from_position_ids",
    "pack_per_token",
    "pack_sequences",
    "restore_outputs",
    "unpack_per_token",
]


@dataclass
class PackedBatch:
    """One THD micro-batch. Segment ``j < num_real_segments`` holds sample ``sample_indices[j]``."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T], int64, restarts at 0 in every segment
    cu_seqlens: torch.Tensor  # [segments + 1], int32, leading 0
    max_seqlen: int
    seq_lens: list[int]  # real lengths of the sample segments (before any CP tail padding)
    seq_pad: list[int]  # CP tail padding inside each sample segment
    sample_indices: list[int]
    alignment_pad_tokens: int  # length of the trailing padding segment (0 = none)
    valid_mask: torch.Tensor  # [T], bool, True on real tokens

    @property
    def num_real_segments(self) -> int:
        return len(self.seq_lens)

    @property
    def total_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def pad_tokens(self) -> int:
        """All non-real tokens: the alignment segment plus CP tail padding."""
        return self.alignment_pad_tokens + sum(self.seq_pad)


def _layout(lengths: Sequence[int], alignment: int, cp_size: int) -> tuple[list[int], list[int], int]:
    """Per-sample tail padding (CP only), and the trailing alignment segment length."""
    if alignment < 1 or cp_size < 1:
        raise ValueError(f"alignment and cp_size must be >= 1, got {alignment}, {cp_size}")
    chunk = 2 * cp_size if cp_size > 1 else 1
    if alignment % chunk:
        raise ValueError(f"alignment {alignment} must be a multiple of 2 * cp_size = {chunk}")
    for i, s in enumerate(lengths):
        if int(s) <= 0:
            raise ValueError(f"sample {i} has non-positive length {s}")
    seq_pad = [(-int(s)) % chunk for s in lengths]
    used = sum(int(s) for s in lengths) + sum(seq_pad)
    tail = (-used) % alignment
    if used == 0:  # an empty micro-batch (a rank with fewer sequences than the agreed count)
        tail = alignment
    return seq_pad, [int(s) + p for s, p in zip(lengths, seq_pad)], tail


def pack_per_token(
    tensors: Sequence[torch.Tensor], batch: PackedBatch, pad_value: float | int | bool = 0
) -> torch.Tensor:
    """Pack a per-token field (labels, loss masks, log-probs, MTP labels...) like ``batch``.

    ``tensors[j]`` belongs to segment ``j`` and has ``batch.seq_lens[j]`` rows; pads get ``pad_value``.
    """
    if len(tensors) != batch.num_real_segments:
        raise ValueError(f"got {len(tensors)} tensors for {batch.num_real_segments} packed sequences")
    pieces = []
    for j, (t, s, p) in enumerate(zip(tensors, batch.seq_lens, batch.seq_pad)):
        if t.shape[0] != s:
            raise ValueError(f"tensor {j} has {t.shape[0]} rows, its sequence has {s} tokens")
        pieces.append(t)
        if p:
            pieces.append(t.new_full((p, *t.shape[1:]), pad_value))
    if batch.alignment_pad_tokens:
        ref = tensors[0] if tensors else torch.zeros(0, dtype=batch.input_ids.dtype)
        pieces.append(ref.new_full((batch.alignment_pad_tokens, *ref.shape[1:]), pad_value))
    return torch.cat(pieces, dim=0)


def pack_sequences(
    sequences: Sequence[torch.Tensor],
    alignment: int = 1,
    cp_size: int = 1,
    pad_token_id: int = 0,
    sample_indices: Sequence[int] | None = None,
) -> PackedBatch:
    """Pack 1-D token tensors into one THD micro-batch (see the module docstring for the layout)."""
    lengths = [int(t.shape[0]) for t in sequences]
    seq_pad, seg_lens, tail = _layout(lengths, alignment, cp_size)
    if tail:
        seg_lens = seg_lens + [tail]
    device = sequences[0].device if sequences else torch.device("cpu")
    seg = torch.tensor(seg_lens, dtype=torch.int64, device=device)
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(seg, 0).to(torch.int32)
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1].to(torch.int64), seg)
    position_ids = torch.arange(total, dtype=torch.int64, device=device) - starts
    proto = PackedBatch(
        input_ids=torch.empty(0),
        position_ids=position_ids,
        cu_seqlens=cu,
        max_seqlen=max(seg_lens),
        seq_lens=lengths,
        seq_pad=seq_pad,
        sample_indices=list(sample_indices) if sample_indices is not None else list(range(len(lengths))),
        alignment_pad_tokens=tail,
        valid_mask=torch.empty(0),
    )
    if sequences:
        proto.input_ids = pack_per_token(sequences, proto, pad_token_id)
    else:
        proto.input_ids = torch.full((total,), pad_token_id, dtype=torch.int64)
    proto.valid_mask = (
        pack_per_token([torch.ones(s, dtype=torch.bool, device=device) for s in lengths], proto, False)
        if lengths
        else torch.zeros(total, dtype=torch.bool)
    )
    return proto


def unpack_per_token(packed: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Inverse of :func:`pack_per_token`: the real rows of each sample segment, in segment order."""
    cu = batch.cu_seqlens.tolist()
    return [packed[cu[j] : cu[j] + s] for j, s in enumerate(batch.seq_lens)]


def restore_outputs(per_mb: Sequence[Sequence[torch.Tensor]], plan: Sequence[Sequence[int]]) -> list:
    """Per-sample outputs of every micro-batch (``per_mb[m][j]`` for sample ``plan[m][j]``) back in
    the batch's original order."""
    flat = [out for mb in per_mb for out in mb]
    if len(flat) != sum(len(mb) for mb in plan):
        raise ValueError("outputs do not match the plan")
    return [flat[r] for r in restore_order(plan)]


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment boundaries where positions restart at 0: ``cu = [starts..., T]`` (int32)."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().view(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([torch.zeros(1, dtype=starts.dtype, device=pos.device), starts])
    end = torch.tensor([pos.numel()], dtype=starts.dtype, device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)
