"""Zigzag context-parallel split of a packed (THD) batch.

Every segment ``[a, a + L)`` of ``cu_seqlens`` (``L`` a multiple of ``2 * cp``, see
:mod:`areal_npu.data.packed_layout`) is cut into ``2 * cp`` equal chunks of ``c = L / (2 cp)``
tokens; rank ``r`` keeps chunks ``r`` and ``2cp - 1 - r``:

    local_r = concat over segments of x[a + r c : a + (r+1) c] ++ x[a + (2cp-1-r) c : a + (2cp-r) c]

so each rank holds ``T / cp`` tokens and an equal share of causal attention work (an early chunk
pairs with a late one). The local ``cu_seqlens`` is ``cu_seqlens / cp``. The same index set splits
every per-token tensor (ids, positions, labels, loss masks, MTP labels/masks, log-probs); roll MTP
labels per segment *before* the split. :func:`cp_gather` is the inverse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "cp_all_gather",
    "cp_gather",
    "cp_local_cu_seqlens",
    "cp_split",
    "cp_split_batch",
    "zigzag_indices",
]


def zigzag_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices rank ``cp_rank`` keeps, in local order (int64, on cu_seqlens' device)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got rank {cp_rank}, size {cp_size}")
    if cp_size == 1:  # no context parallelism: the rank keeps everything
        return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
    cu = cu_seqlens.tolist()
    n_chunks = 2 * cp_size
    pieces = []
    for j in range(len(cu) - 1):
        a, length = cu[j], cu[j + 1] - cu[j]
        if length % n_chunks:
            raise ValueError(f"segment {j} has {length} tokens, not a multiple of 2 * cp_size = {n_chunks}")
        c = length // n_chunks
        pieces.append(torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c))
        pieces.append(torch.arange(a + (n_chunks - 1 - cp_rank) * c, a + (n_chunks - cp_rank) * c))
    if not pieces:
        return torch.zeros(0, dtype=torch.int64, device=cu_seqlens.device)
    return torch.cat(pieces).to(cu_seqlens.device)


def cp_local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Each segment keeps ``L / cp`` tokens on every rank: ``cu_local = cu / cp``."""
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor").to(cu_seqlens.dtype)


def cp_split(t: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s part of per-token tensor ``t`` (tokens on dim 0)."""
    if cp_size == 1:
        return t
    return t.index_select(0, zigzag_indices(cu_seqlens, cp_size, cp_rank).to(t.device))


def cp_split_batch(
    tensors: Mapping[str, torch.Tensor | None], cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int
) -> dict:
    """Split every tensor whose dim 0 is the token count ``T``; pass everything else through.

    ``cu_seqlens`` itself becomes the local one.
    """
    total = int(cu_seqlens[-1])
    idx = zigzag_indices(cu_seqlens, cp_size, cp_rank) if cp_size > 1 else None
    out = {}
    for key, value in tensors.items():
        if key == "cu_seqlens":
            out[key] = cp_local_cu_seqlens(cu_seqlens, cp_size)
        elif idx is not None and isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == total:
            out[key] = value.index_select(0, idx.to(value.device))
        else:
            out[key] = value
    return out


def cp_gather(parts: Sequence[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of the split: ``parts[r]`` is rank ``r``'s local tensor; returns the full ``[T, ...]``."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    total = int(cu_seqlens[-1])
    out = parts[0].new_empty((total, *parts[0].shape[1:]))
    for r, part in enumerate(parts):
        out[zigzag_indices(cu_seqlens, cp_size, r).to(part.device)] = part
    return out


def cp_all_gather(local: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> torch.Tensor:
    """Gather rank-local parts over the context-parallel ``group`` and undo the zigzag (no grad)."""
    import torch.distributed as dist

    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return cp_gather(parts, cu_seqlens)
