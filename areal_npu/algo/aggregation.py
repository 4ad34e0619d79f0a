"""Per-token loss → scalar, and KL estimators to a reference policy.

Both aggregation modes divide by a GLOBAL denominator supplied by the caller, so a step split into
micro-batches (and ranks) adds up: with the same denominator everywhere,
``Σ_mb aggregate(mb) == aggregate(whole batch)``, values and gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from areal_npu.algo.segments import resolve_segment_ids, segment_count, segment_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregate_loss(
    token_loss: Tensor,
    loss_mask: Tensor,
    mode: str = "token-mean",
    *,
    global_denominator: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    contribution_mask: Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss ℓ_t to a scalar.

    token-mean:  L = Σ_t m_t·ℓ_t / N_tok,   N_tok = number of valid tokens in the global batch
    seq-mean:    L = Σ_s [ Σ_{t∈s} m_t·ℓ_t / |{t∈s: m_t}| ] / N_seq,
                 N_seq = number of sequences with ≥ 1 valid token in the global batch

    m = ``loss_mask``. ``global_denominator`` is N_tok or N_seq summed over all micro-batches and
    ranks of the step; when None the local count is used (a single micro-batch on one rank).
    ``contribution_mask`` (⊆ loss_mask) zeroes tokens' contributions without changing any
    denominator (used for importance-weight outlier masking). Sequences must not be split across
    micro-batches for seq-mean to add up. Masked positions may hold NaN/Inf: they are selected
    away with ``torch.where``, never multiplied by 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {mode!r}")
    mask = loss_mask.to(torch.bool)
    keep = mask if contribution_mask is None else mask & contribution_mask.to(torch.bool)
    zero = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    contrib = torch.where(keep, token_loss, zero)
    if mode == "token-mean":
        denom = mask.sum() if global_denominator is None else global_denominator
        return contrib.sum() / _as_positive(denom, token_loss)
    seg, num_segments = resolve_segment_ids(token_loss, segment_ids, cu_seqlens)
    per_seq_sum = segment_sum(contrib, seg, num_segments)
    per_seq_count = segment_count(seg, num_segments, mask)
    per_seq_mean = torch.where(
        per_seq_count > 0, per_seq_sum / per_seq_count.clamp(min=1).to(per_seq_sum.dtype), zero
    )
    denom = (per_seq_count > 0).sum() if global_denominator is None else global_denominator
    return per_seq_mean.sum() / _as_positive(denom, token_loss)


def _as_positive(denom: float | int | Tensor, like: Tensor) -> Tensor:
    d = torch.as_tensor(denom, dtype=like.dtype, device=like.device)
    # an empty global batch contributes 0, not NaN
    return d.clamp(min=1)


def kl_estimate(logp: Tensor, logp_ref: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) on samples, with δ = log π_ref − log π_θ:

    k1 = −δ                  (unbiased, can be negative)
    k2 = ½ δ²                (biased, low variance)
    k3 = exp(δ) − δ − 1      (unbiased, ≥ 0; Schulman's estimator)
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    delta = logp_ref - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    return torch.expm1(delta) - delta
