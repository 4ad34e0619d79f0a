"""The Megatron engine's loss and stats plumbing: the loss of one packed micro-batch (decoupled PPO
or SFT), stats merged over micro-batches and the DP x CP ranks, the stats of several PPO
mini-batches, and the collectives behind them (:mod:`.engine` uses these).

Nothing here imports Megatron.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_npu.algo.ppo import PPOConfig, decoupled_ppo_loss
from areal_npu.platform import current_platform
from areal_npu.train.megatron.packing import MegatronMicroBatch


def reduce_floats(values: list[float], op, group) -> list[float]:
    """``values`` all-reduced with ``op`` over ``group`` (float64; as they are without a group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=current_platform().current_device())
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` in place over ``group`` with one collective."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _additive(key: str) -> bool:
    return key.startswith("mtp/") or key in ("ppo/loss", "ppo/n_valid_tokens")


def merge_stats(per_mb: list[tuple[float, dict[str, float]]], group) -> dict[str, float]:
    """As :func:`areal_npu.train.forward.merge_stats`, over ``group`` (the DP x CP ranks: TP ranks
    hold copies of the same numbers and must not be counted twice)."""
    keys = sorted({k for _, s in per_mb for k in s})
    out = {}
    for key in keys:
        vals = [(w, s[key]) for w, s in per_mb if key in s]
        if _additive(key):
            out[key] = reduce_floats([sum(v for _, v in vals)], dist.ReduceOp.SUM, group)[0]
        elif key.endswith("/min"):
            out[key] = -reduce_floats([-min(v for _, v in vals)], dist.ReduceOp.MAX, group)[0]
        elif key.endswith("/max"):
            out[key] = reduce_floats([max(v for _, v in vals)], dist.ReduceOp.MAX, group)[0]
        else:
            num, den = reduce_floats(
                [sum(w * v for w, v in vals), sum(w for w, _ in vals)], dist.ReduceOp.SUM, group
            )
            out[key] = num / den if den else 0.0
    return out


def merge_minibatch_stats(per: list[dict[str, float]], version: int) -> dict[str, float]:
    """The stats of one train step from those of its PPO mini-batches (each already global): max /
    min of ``/max`` / ``/min`` keys, the sum of the token counts, the mean of the rest."""
    merged = {}
    for key in per[0]:
        values = [p[key] for p in per if key in p]
        if key.endswith("/max"):
            merged[key] = max(values)
        elif key.endswith("/min"):
            merged[key] = min(values)
        elif key == "train/n_tokens":
            merged[key] = sum(values)
        else:
            merged[key] = sum(values) / len(values)
    merged["train/version"] = float(version)
    return merged


def micro_batch_loss(
    loss: str,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    mb: MegatronMicroBatch,
    ppo_config: PPOConfig,
    denominator: float,
    policy_version: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss to backpropagate, its stats) of one micro-batch: ``loss`` is ``"ppo"`` (decoupled PPO,
    normalised by the global ``denominator``) or ``"sft"`` (the masked NLL over ``denominator``)."""
    f = mb.fields
    if loss == "ppo":
        main, stats = decoupled_ppo_loss(
            logp,
            f["adv_tok"],
            f["loss_mask"],
            logp_behave=f["behave_logp"],
            logp_prox=f["prox_logp"],
            config=ppo_config,
            global_denominator=denominator,
            cu_seqlens=mb.params.cu_seqlens_q if mb.cp_size == 1 else None,
            entropy=entropy.detach(),
            versions=f["versions"],
            policy_version=policy_version,
        )
        return main, {k: float(v) for k, v in stats.items()}
    mask = f["loss_mask"]
    main = -(torch.where(mask, logp, torch.zeros_like(logp))).sum() / max(denominator, 1.0)
    n = max(int(mask.sum()), 1)
    stats = {
        "sft/nll": float(-(logp.detach() * mask).sum() / n),
        "sft/entropy": float((entropy.detach() * mask).sum() / n),
    }
    return main, stats
