"""How per-micro-batch stats become the step's stats, over the ranks an engine names.

An engine passes the group whose ranks hold *different* tokens (FSDP2: every rank; Megatron: the
data- and context-parallel ranks, not the tensor-parallel copies), so nothing is counted twice.
"""

from __future__ import annotations

import math

from areal_npu import names
from areal_npu.train.dist import all_reduce_max, all_reduce_sum

__all__ = ["merge_minibatch_stats", "merge_stats"]


def _additive(key: str) -> bool:
    """Stats that are already fractions of a global normaliser: they add up over micro-batches."""
    drafters = (names.MTP_STATS, names.EAGLE3_STATS)
    return key.startswith(drafters) or key in (names.PPO_LOSS, names.PPO_N_VALID_TOKENS)


def merge_stats(per_mb: list[tuple[float, dict[str, float]]], group=None) -> dict[str, float]:
    """Across micro-batches and the ranks of ``group``: sums for additive keys, min / max for
    ``/min`` / ``/max`` keys, means weighted by each micro-batch's loss-mask tokens for the rest.
    Min / max skip micro-batches without loss tokens (their masked stats read 0, not a value: a
    CP rank's zigzag share or a DP rank's micro-batch can hold none); 0 when no rank has any."""
    keys = sorted({k for _, s in per_mb for k in s})
    out = {}
    for key in keys:
        vals = [(w, s[key]) for w, s in per_mb if key in s]
        counted = [v for w, v in vals if w > 0]
        if _additive(key):
            out[key] = all_reduce_sum([sum(v for _, v in vals)], group)[0]
        elif key.endswith(("/min", "/max")):
            sign = -1.0 if key.endswith("/min") else 1.0
            top = all_reduce_max([max((sign * v for v in counted), default=-math.inf)], group)[0]
            out[key] = sign * top if math.isfinite(top) else 0.0
        else:
            num, den = all_reduce_sum([sum(w * v for w, v in vals), sum(w for w, _ in vals)], group)
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
        elif key == names.TRAIN_N_TOKENS:
            merged[key] = sum(values)
        else:
            merged[key] = sum(values) / len(values)
    merged[names.TRAIN_VERSION] = float(version)
    return merged


def minibatch_train_step(engine, samples, loss, step, n: int) -> dict[str, float]:
    """One training step of ``engine`` (either backend) as ``n`` PPO mini-batches: optimizer steps over
    interleaved slices of ``samples`` (each normalised by its own global counts), one version bump at
    the end; the mini-batches' stats merged."""
    if len(samples) < n:
        raise ValueError(f"{len(samples)} samples cannot fill ppo_minibatches={n}")
    per = []
    for i in range(n):
        stats = engine.forward_backward(samples[i::n], loss, step)
        stats.update(engine.optimizer_step(step, bump_version=i == n - 1))
        per.append(stats)
    return per[0] if n == 1 else merge_minibatch_stats(per, engine.version)
