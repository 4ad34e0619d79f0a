"""Decoupled PPO loss for asynchronous RL (clip-higher, dual clip, behaviour importance weight).

Rollouts are sampled from a stale behaviour policy π_behave. Before the update the trainer
recomputes proximal log-probs log π_prox with the current weights; the importance ratio splits as

    π_θ / π_behave = (π_θ / π_prox) · (π_prox / π_behave)
                      └─ trainable, clipped ─┘  └─ behave_imp_weight: constant ─┘

The per-token decoupled loss is  ℓ_t = w_t · ℓ^clip_t(π_θ/π_prox)  with w_t = exp(log π_prox −
log π_behave) detached. In decoupled mode w_t ALWAYS multiplies the loss (there is no switch to
skip it); outlier control (cap or mask, token or sequence level) only bounds it. With
``decoupled=False`` the anchor is π_behave itself and no weight applies (standard PPO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from areal_npu import names
from areal_npu.algo import stats as S
from areal_npu.algo.aggregation import KL_ESTIMATORS, LOSS_AGG_MODES, aggregate_loss, kl_estimate
from areal_npu.algo.segments import resolve_segment_ids, segment_mean

IMP_WEIGHT_MODES = ("none", "clamp", "mask")
IMP_WEIGHT_LEVELS = ("token", "sequence")
NONFINITE_MODES = ("raise", "drop")


@dataclass
class PPOConfig:
    """Loss configuration; ``validate()`` raises ValueError naming the offending key."""

    eps_clip_low: float = 0.2  # ratio floor 1 − eps_clip_low
    eps_clip_high: float | None = None  # ratio ceiling 1 + eps_clip_high (clip-higher); None: = low
    dual_clip: float | None = None  # c > 1: loss ≤ −c·A for A < 0; None: off
    decoupled: bool = True
    behave_imp_weight_mode: str = "none"  # none | clamp | mask
    behave_imp_weight_cap: float | None = None  # required when mode != none
    behave_imp_weight_level: str = "token"  # token | sequence (geometric mean over the sequence)
    loss_agg: str = "token-mean"  # token-mean | seq-mean
    kl_coef: float = 0.0  # coefficient of the KL penalty to the reference policy
    kl_estimator: str = "k3"  # k1 | k2 | k3
    on_nonfinite: str = "raise"  # raise | drop (see areal_npu.algo.guard)

    @property
    def clip_high(self) -> float:
        return self.eps_clip_low if self.eps_clip_high is None else self.eps_clip_high

    def validate(self) -> PPOConfig:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"PPOConfig.{key} {why}, got {getattr(self, key)!r}")

        if not 0.0 < self.eps_clip_low < 1.0:
            raise bad("eps_clip_low", "must be in (0, 1)")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0.0:
            raise bad("eps_clip_high", "must be > 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise bad("dual_clip", "must be > 1 (or None to disable)")
        if self.behave_imp_weight_mode not in IMP_WEIGHT_MODES:
            raise bad("behave_imp_weight_mode", f"must be one of {IMP_WEIGHT_MODES}")
        if self.behave_imp_weight_level not in IMP_WEIGHT_LEVELS:
            raise bad("behave_imp_weight_level", f"must be one of {IMP_WEIGHT_LEVELS}")
        if self.behave_imp_weight_mode != "none":
            if self.behave_imp_weight_cap is None or not self.behave_imp_weight_cap >= 1.0:
                raise bad("behave_imp_weight_cap", "must be >= 1 when behave_imp_weight_mode is set")
            if not self.decoupled:
                raise bad("decoupled", "must be True when behave_imp_weight_mode is set")
        elif self.behave_imp_weight_cap is not None:
            raise bad("behave_imp_weight_cap", "is set but behave_imp_weight_mode is 'none'")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise bad("loss_agg", f"must be one of {LOSS_AGG_MODES}")
        if not self.kl_coef >= 0.0:
            raise bad("kl_coef", "must be >= 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise bad("kl_estimator", f"must be one of {KL_ESTIMATORS}")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise bad("on_nonfinite", f"must be one of {NONFINITE_MODES}")
        return self


class ClipOutput(NamedTuple):
    loss: Tensor  # per-token clipped surrogate loss
    ratio: Tensor  # π_θ / π_anchor
    clipped: Tensor  # bool: the clipped branch is the active (larger) one
    dual_clipped: Tensor  # bool: the dual-clip bound −c·A is active


def ppo_clip_token_loss(
    logp: Tensor,
    logp_anchor: Tensor,
    advantages: Tensor,
    *,
    eps_clip_low: float,
    eps_clip_high: float,
    dual_clip: float | None = None,
) -> ClipOutput:
    """Per-token PPO clipped surrogate loss with asymmetric clip and optional dual clip.

        r_t   = exp(log π_θ − log π_anchor)
        ℓ_t   = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))
        dual:  ℓ_t = min(ℓ_t, −c·A_t)   for A_t < 0   (Ye et al. 2020, c > 1)

    ``clipped`` marks tokens where the clipped term is strictly larger (its gradient is zero);
    ``dual_clipped`` marks A_t < 0 tokens where ℓ_t was replaced by −c·A_t.
    """
    ratio = torch.exp(logp - logp_anchor)
    unclipped = -advantages * ratio
    clipped_term = -advantages * torch.clamp(ratio, 1.0 - eps_clip_low, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    if dual_clip is None:
        return ClipOutput(loss, ratio, clipped, torch.zeros_like(clipped))
    bound = -dual_clip * advantages
    dual_clipped = (advantages < 0) & (loss > bound)
    loss = torch.where(dual_clipped, bound, loss)
    return ClipOutput(loss, ratio, clipped & ~dual_clipped, dual_clipped)


class ImpWeight(NamedTuple):
    weight: Tensor  # detached behave_imp_weight after outlier control (1 outside the mask)
    raw: Tensor  # detached exp(log π_prox − log π_behave) before outlier control
    keep: Tensor  # bool: token keeps its contribution (False only in mask mode)
    outlier: Tensor  # bool: token is (in) an outlier at the configured level


def behave_importance_weight(
    logp_prox: Tensor,
    logp_behave: Tensor,
    loss_mask: Tensor,
    *,
    mode: str = "none",
    cap: float | None = None,
    level: str = "token",
    segment_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> ImpWeight:
    """behave_imp_weight w_t = exp(log π_prox,t − log π_behave,t), detached, with outlier control.

    token level:    outlier_t = w_t > cap
                    clamp → w_t ← min(w_t, cap);   mask → token t contributes nothing
    sequence level: g_s = exp( mean_{t∈s, valid} (log π_prox,t − log π_behave,t) )  (geometric mean)
                    outlier_s = g_s > cap
                    clamp → w_t ← w_t · min(1, cap / g_s)  (the sequence's geometric mean becomes cap,
                            per-token shape kept);   mask → every token of s contributes nothing
    Masking zeroes contributions but leaves loss denominators unchanged.
    """
    if mode not in IMP_WEIGHT_MODES:
        raise ValueError(f"behave_imp_weight_mode must be one of {IMP_WEIGHT_MODES}, got {mode!r}")
    mask = loss_mask.to(torch.bool)
    with torch.no_grad():
        log_w = torch.where(
            mask,
            logp_prox.detach() - logp_behave.detach(),
            torch.zeros((), dtype=logp_prox.dtype, device=logp_prox.device),
        )
        raw = torch.exp(log_w)
        if mode == "none":
            return ImpWeight(raw, raw, mask, torch.zeros_like(mask))
        if cap is None:
            raise ValueError("behave_imp_weight_cap is required when behave_imp_weight_mode is set")
        if level == "token":
            outlier = mask & (raw > cap)
            if mode == "clamp":
                return ImpWeight(raw.clamp(max=cap), raw, mask, outlier)
            return ImpWeight(torch.where(outlier, torch.zeros_like(raw), raw), raw, mask & ~outlier, outlier)
        if level != "sequence":
            raise ValueError(f"behave_imp_weight_level must be one of {IMP_WEIGHT_LEVELS}, got {level!r}")
        seg, num_segments = resolve_segment_ids(log_w, segment_ids, cu_seqlens)
        seq_log_g = segment_mean(log_w, seg, num_segments, mask)
        tok_log_g = seq_log_g[seg.clamp(min=0)]
        log_cap = math.log(cap)
        outlier = mask & (tok_log_g > log_cap)
        if mode == "clamp":
            scale = torch.exp(torch.clamp(log_cap - tok_log_g, max=0.0))
            return ImpWeight(torch.where(mask, raw * scale, raw), raw, mask, outlier)
        return ImpWeight(torch.where(outlier, torch.zeros_like(raw), raw), raw, mask & ~outlier, outlier)


def decoupled_ppo_loss(
    logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    logp_behave: Tensor,
    logp_prox: Tensor | None = None,
    config: PPOConfig,
    global_denominator: float | int | Tensor | None = None,
    segment_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    policy_version: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / decoupled PPO loss of one micro-batch and its stats.

    All token tensors share one shape ([T] packed, or [B, L]); ``loss_mask`` marks response tokens.
    ``logp`` carries the gradient; ``logp_behave``, ``logp_prox``, ``advantages``, ``logp_ref`` are
    constants supplied by the caller (w_t is detached here regardless). Per token:

        anchor = log π_prox if config.decoupled else log π_behave
        ℓ_t    = w_t · ℓ^clip_t(log π_θ − anchor)          (w_t = 1 when not decoupled)
               + kl_coef · KL_est(log π_θ, log π_ref)       (when kl_coef > 0)
        L      = aggregate(ℓ, loss_mask, config.loss_agg, global_denominator)

    See :func:`ppo_clip_token_loss`, :func:`behave_importance_weight`,
    :func:`areal_npu.algo.aggregation.aggregate_loss`. ``global_denominator`` is the number of
    valid tokens (token-mean) or sequences (seq-mean) in the whole step across micro-batches and
    ranks. Segment ids / cu_seqlens are needed for seq-mean and sequence-level weights.
    ``versions`` (per-token behaviour weight version) and ``policy_version`` feed version-lag stats.

    Stats (detached 0-d tensors over valid tokens): ppo/loss, ppo/n_valid_tokens,
    ppo/importance_weight, ppo/clip_ratio, ppo/dual_clip_ratio, ppo/approx_kl = mean(anchor − log π_θ),
    and when decoupled ppo/behave_imp_weight/{mean,min,max} (raw, before outlier control),
    ppo/behave_imp_weight/outlier_ratio, ppo/behave_approx_kl = mean(log π_behave − log π_prox);
    optionally ppo/entropy, ppo/kl_ref, ppo/version_lag/{mean,max}.
    """
    config.validate()
    mask = loss_mask.to(torch.bool)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    def clean(x: Tensor) -> Tensor:
        # Masked positions may hold garbage (prompt tokens, padding); select them away *before* any
        # arithmetic so neither the loss nor its gradient can pick up NaN/Inf from them.
        return torch.where(mask, x, zero)

    logp_c = clean(logp)
    behave_c = clean(logp_behave)
    adv_c = clean(advantages.to(logp.dtype))
    if config.decoupled:
        if logp_prox is None:
            raise ValueError("decoupled PPO needs logp_prox (log-probs recomputed with the current weights)")
        anchor = clean(logp_prox)
    else:
        anchor = behave_c

    clip = ppo_clip_token_loss(
        logp_c,
        anchor,
        adv_c,
        eps_clip_low=config.eps_clip_low,
        eps_clip_high=config.clip_high,
        dual_clip=config.dual_clip,
    )
    token_loss = clip.loss
    contribution = mask
    stats: dict[str, Tensor] = {}
    if config.decoupled:
        imp = behave_importance_weight(
            anchor,
            behave_c,
            mask,
            mode=config.behave_imp_weight_mode,
            cap=config.behave_imp_weight_cap,
            level=config.behave_imp_weight_level,
            segment_ids=segment_ids,
            cu_seqlens=cu_seqlens,
        )
        token_loss = token_loss * imp.weight.detach()
        contribution = imp.keep
        stats.update(S.mean_min_max(names.BEHAVE_IMP_WEIGHT, imp.raw, mask))
        stats[names.BEHAVE_IMP_WEIGHT_OUTLIER_RATIO] = S.masked_ratio(imp.outlier, mask)
        stats[names.BEHAVE_APPROX_KL] = S.masked_mean(behave_c - anchor, mask)
    if config.kl_coef > 0.0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs logp_ref")
        kl = kl_estimate(logp_c, clean(logp_ref), config.kl_estimator)
        token_loss = token_loss + config.kl_coef * kl
        stats[names.PPO_KL_REF] = S.masked_mean(kl, mask)

    loss = aggregate_loss(
        token_loss,
        mask,
        config.loss_agg,
        global_denominator=global_denominator,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        contribution_mask=contribution,
    )
    stats[names.PPO_LOSS] = loss.detach()
    stats[names.PPO_N_VALID_TOKENS] = mask.sum().to(torch.float32)
    stats[names.PPO_IMPORTANCE_WEIGHT] = S.masked_mean(clip.ratio, mask)
    stats[names.PPO_CLIP_RATIO] = S.masked_ratio(clip.clipped, mask)
    stats[names.PPO_DUAL_CLIP_RATIO] = S.masked_ratio(clip.dual_clipped, mask)
    stats[names.PPO_APPROX_KL] = S.masked_mean(anchor - logp_c, mask)
    if entropy is not None:
        stats[names.PPO_ENTROPY] = S.masked_mean(entropy, mask)
    if versions is not None:
        if policy_version is None:
            raise ValueError("versions given without policy_version")
        lag = policy_version - versions.to(torch.long)
        stats[names.VERSION_LAG_MEAN] = S.masked_mean(lag, mask)
        stats[names.VERSION_LAG_MAX] = S.masked_max(lag, mask)
    return loss, stats
