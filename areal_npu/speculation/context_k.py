"""Context-aware draft length: one k per context bucket, chosen on the cost model from that bucket's
measured acceptance, down to k = 0 where speculation no longer pays.

For a bucket whose per-position acceptance is ``u_0 .. u_{m-1}`` (``rollout/spec_ctx_<b>_accept_rate_pos<i>``)
and a draft position costing ``r`` autoregressive steps (``adapt.draft_cost``), the generation speed-up at
draft length k is (:mod:`areal_npu.speculation.cost`, batch-free)::

    a(k) = E[L_k] / (1 + r·k),   E[L_k] = 1 + Σ_{i<k} u_i      (a(0) = 1)

and the bucket runs ``k* = argmax_k a(k)`` over ``{0} ∪ [k_min, k_max]``, or 0 unless
``a(k*) ≥ 1 + min_gain``. Positions deeper than measured repeat the deepest measured conditional
acceptance (:func:`areal_npu.speculation.planner.extend_acceptance`), and k rises at most one past the
deepest measured position per decision, so deeper drafts are measured before they are trusted.

:class:`ContextAwareK` keeps, per bucket, the drafts-weighted acceptance of the last ``window``
steps that measured each position; a position not measured for ``baseline_every`` steps is forgotten,
and a bucket left at k = 0 is probed again at ``k_init`` after ``reprobe_every`` steps (its
measurements forgotten). A bucket never measured runs ``k_init``. The engines apply the table per
scheduler step from the batch's dominant bucket (:func:`areal_npu.speculation.k_driver.batch_k`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from areal_npu import names
from areal_npu.speculation.context import BUCKET_LABELS
from areal_npu.speculation.planner import conditional_from_unconditional, expected_accepted_length
from areal_npu.speculation.policy import SpecAdaptConfig


def speedup(u: Sequence[float], k: int, draft_cost: float) -> float:
    """``a(k) = E[L_k] / (1 + r·k)``, positions past ``len(u)`` extrapolated (see the module docstring)."""
    if k == 0:
        return 1.0
    length = expected_accepted_length(conditional_from_unconditional(u), k) if u else 1.0
    return length / (1.0 + draft_cost * k)


def choose_k(u: Sequence[float], draft_cost: float, k_min: int, k_max: int, min_gain: float) -> int:
    """The draft length for one bucket: argmax of :func:`speedup` over ``{0} ∪ [k_min, k_max]``,
    capped one past the measured depth ``len(u)``; 0 unless it gains ``min_gain``."""
    top = min(k_max, max(len(u) + 1, k_min))
    best = max(range(k_min, top + 1), key=lambda k: (speedup(u, k, draft_cost), -k), default=0)
    return best if best and speedup(u, best, draft_cost) >= 1.0 + min_gain else 0


class ContextAwareK:
    """One k per bucket of :data:`~areal_npu.speculation.context.BUCKET_LABELS` (module docstring)."""

    def __init__(self, config: SpecAdaptConfig):
        self.config = config.validate()
        n = len(BUCKET_LABELS)
        self.k = [config.k_init] * n
        self.step = 0
        # per bucket, per position: (step, accepted, drafted) of the last `window` steps that measured it
        self._seen: list[list[deque]] = [[] for _ in range(n)]
        self._off_since: list[int | None] = [None] * n

    def profile(self, bucket: int) -> list[float]:
        """``u_0 ..`` as measured for ``bucket`` (recent, drafts-weighted), up to its first gap."""
        out = []
        for samples in self._seen[bucket]:
            fresh = [(a, d) for s, a, d in samples if self.step - s <= self.config.baseline_every]
            drafted = sum(d for _, d in fresh)
            if not drafted:
                break
            out.append(sum(a for a, _ in fresh) / drafted)
        return out

    def observe(self, stats: Mapping[str, float]) -> list[int]:
        """One step's stats (``rollout/spec_ctx_*``) in, the k table for the next step out."""
        cfg = self.config
        self.step += 1
        for b, label in enumerate(BUCKET_LABELS):
            drafts = float(stats.get(names.spec_ctx_key(label, "drafts"), 0.0))
            pos = 0
            while drafts > 0 and (key := names.spec_ctx_key(label, f"accept_rate_pos{pos}")) in stats:
                if pos == len(self._seen[b]):
                    self._seen[b].append(deque(maxlen=cfg.window))
                self._seen[b][pos].append((self.step, float(stats[key]) * drafts, drafts))
                pos += 1
        for b in range(len(BUCKET_LABELS)):
            u = self.profile(b)
            if self.k[b] == 0:
                since = self._off_since[b] if self._off_since[b] is not None else self.step
                if self.step - since >= cfg.reprobe_every:
                    self._seen[b] = []
                    self._off_since[b] = None
                    self.k[b] = cfg.k_init
                continue
            if not u:
                continue  # nothing measured here yet: keep what runs
            self.k[b] = choose_k(u, cfg.draft_cost, cfg.k_min, cfg.k_max, cfg.min_gain)
            if self.k[b] == 0:
                self._off_since[b] = self.step
        return list(self.k)

    def table_stats(self) -> dict[str, float]:
        """``rollout/spec_ctx_<b>_k`` of every bucket: the k set for the next step."""
        return {
            names.spec_ctx_key(label, "k"): float(k) for label, k in zip(BUCKET_LABELS, self.k, strict=True)
        }
