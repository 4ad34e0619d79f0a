"""Masked statistics for training logs: detached 0-d tensors, safe on empty masks.

An empty mask yields 0 for every statistic (never NaN, so a non-finite check on logged stats only
fires on real problems); callers that need to weight means across micro-batches also log the count.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(values: Tensor, mask: Tensor | None) -> Tensor:
    values = values.detach()
    if mask is None:
        return values.reshape(-1)
    return values[mask.to(torch.bool)]


def masked_mean(values: Tensor, mask: Tensor | None = None) -> Tensor:
    """``Σ_t mask[t]·v[t] / Σ_t mask[t]`` (0 when the mask is empty), computed in float32 or wider."""
    sel = _masked(values, mask)
    if sel.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return sel.to(torch.promote_types(sel.dtype, torch.float32)).mean()


def masked_min(values: Tensor, mask: Tensor | None = None) -> Tensor:
    sel = _masked(values, mask)
    if sel.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return sel.min().to(torch.promote_types(sel.dtype, torch.float32))


def masked_max(values: Tensor, mask: Tensor | None = None) -> Tensor:
    sel = _masked(values, mask)
    if sel.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    return sel.max().to(torch.promote_types(sel.dtype, torch.float32))


def masked_ratio(flags: Tensor, mask: Tensor | None = None) -> Tensor:
    """Fraction of masked-in positions where ``flags`` is true."""
    return masked_mean(flags.to(torch.float32), mask)


def mean_min_max(prefix: str, values: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
    """``{prefix/mean, prefix/min, prefix/max}`` over the masked-in values."""
    return {
        f"{prefix}/mean": masked_mean(values, mask),
        f"{prefix}/min": masked_min(values, mask),
        f"{prefix}/max": masked_max(values, mask),
    }


def to_floats(stats: dict[str, Tensor | float | int]) -> dict[str, float]:
    """Convert a stats dict to python floats (one device sync per call)."""
    return {k: float(v.item()) if isinstance(v, Tensor) else float(v) for k, v in stats.items()}
