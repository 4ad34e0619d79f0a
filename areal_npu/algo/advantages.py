"""Group-relative advantages (GRPO, Dr.GRPO), per sequence, broadcast to response tokens.

Layout: ``rewards`` is [B] with the n samples of one prompt adjacent, so group g holds
``rewards[g·n : (g+1)·n]`` (B must be a multiple of n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from areal_npu import names
from areal_npu.algo.segments import broadcast_to_tokens, resolve_segment_ids


@dataclass
class GRPOConfig:
    std_normalize: bool = True  # false: Dr.GRPO (mean-centred only)


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    std_normalize: bool = True,
    unbiased_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sequence group-relative advantages.

    For sample i in group g (n samples, rewards r):

        μ_g = (1/n) Σ_j r_j
        σ_g = sqrt( Σ_j (r_j − μ_g)² / (n − 1) )        (``unbiased_std``; divide by n otherwise)
        A_i = (r_i − μ_g) / (σ_g + eps)                   GRPO  (``std_normalize=True``)
        A_i =  r_i − μ_g                                  Dr.GRPO (``std_normalize=False``)

    A group whose rewards are all equal has no learning signal: its advantages are exactly 0
    (whatever eps is) and it is counted in ``grpo/zero_adv_groups``. Dr.GRPO's second change, no
    per-sequence length normalisation, lives in the loss aggregation: use ``token-mean`` over the
    global batch (a constant divisor shared by all sequences), not ``seq-mean``.

    Returns ``(advantages [B] float, stats)`` with stats ``grpo/zero_adv_groups`` (count),
    ``grpo/zero_adv_group_ratio``, ``grpo/reward_mean``, ``grpo/reward_std_mean`` (mean σ_g).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"batch size {rewards.numel()} is not a multiple of group_size {group_size}")
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = r.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    centered = grouped - mean
    if group_size > 1:
        denom = group_size - 1 if unbiased_std else group_size
        std = (centered.square().sum(dim=1, keepdim=True) / denom).sqrt()
    else:
        std = torch.zeros_like(mean)
    all_equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    adv = centered / (std + eps) if std_normalize else centered
    adv = torch.where(all_equal, torch.zeros_like(adv), adv)
    num_zero = all_equal.sum()
    stats = {
        names.GRPO_ZERO_ADV_GROUPS: num_zero.to(torch.float32),
        names.GRPO_ZERO_ADV_GROUP_RATIO: num_zero.to(torch.float32) / grouped.shape[0],
        names.GRPO_REWARD_MEAN: r.mean(),
        names.GRPO_REWARD_STD_MEAN: std.mean(),
    }
    return adv.reshape(-1), stats


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr.GRPO advantages ``A_i = r_i − μ_g`` (no std division); see :func:`grpo_advantages`."""
    return grpo_advantages(rewards, group_size, std_normalize=False)


def sequence_to_token_advantages(
    seq_advantages: Tensor,
    response_mask: Tensor,
    *,
    segment_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """``A_t = A_{seq(t)}`` on response tokens (``response_mask[t]``), 0 elsewhere.

    Token membership comes from ``cu_seqlens`` (packed 1-D) or ``segment_ids`` (token shape).
    """
    seg, num_segments = resolve_segment_ids(response_mask, segment_ids, cu_seqlens)
    if num_segments > seq_advantages.numel():
        raise ValueError(f"{num_segments} segments but only {seq_advantages.numel()} advantages")
    return broadcast_to_tokens(seq_advantages, seg, response_mask)
