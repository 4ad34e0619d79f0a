"""Adaptive draft length: keep speculation only where it pays, decided from measured throughput.

Pure decision logic (no engine, no clock): the controller feeds one observation per step — the draft
length the engine ran, the per-position acceptance ``u_i`` (the fraction of verify steps whose draft
i+1 was accepted, ``rollout/spec_accept_rate_pos<i>``) and the measured generated tokens per second — and
applies the draft length the policy answers with. Acceptance is a precise statistic after one
step (thousands of drafts), throughput is noisy; so rules 1-2 judge a draft length after
``accept_window`` steps, rules 3-4 after ``window`` steps:

1. mean acceptance ``Σ u_i / k`` below ``off_accept``: speculation off (k = 0) at once;
2. conditional acceptance of the deepest position ``u_k / u_{k-1}`` below ``deep_accept_floor``: k - 1;
3. hill climbing on measured tokens/s: probe the neighbours k ± 1 (and the k = 0 baseline when it is
   older than ``baseline_every`` steps); the incumbent (the k held before a probe) is replaced only
   by a k measured more than ``switch_margin`` faster, so a probe that is merely as fast goes back;
   then hold k for ``explore_every`` steps (doubling, up to ``explore_max``, while exploring keeps
   confirming the same k);
4. the best k not beating the k = 0 baseline by ``min_gain``: speculation off;
5. off for ``reprobe_every`` steps: probe again at the last k that paid; each probe that ends off
   again doubles the wait (up to ``reprobe_max``), a probe that pays resets it.

Each decision comes back as a :class:`SpecDecision` with a human-readable reason.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass
class SpecAdaptConfig:
    k_max: int = 4  # deepest draft the engine was started with (num_speculative_tokens)
    k_min: int = 1  # shallowest draft tried while speculation is on
    k_init: int | None = None  # draft length of the first steps (null: min(2, k_max))
    window: int = 3  # steps measured at a draft length before judging its throughput
    accept_window: int = 1  # steps measured at a draft length before judging its acceptance
    min_gain: float = 0.03  # speculation must beat k = 0 tokens/s by this fraction to stay on
    switch_margin: float = 0.05  # a neighbour must beat the current k by this fraction to move there (noise)
    off_accept: float = 0.05  # mean acceptance below which speculation is switched off at once
    deep_accept_floor: float = 0.2  # conditional acceptance of the deepest draft below which k drops
    explore_every: int = 10  # steps holding a k before the neighbours are probed again
    explore_max: int = 80  # the hold doubles, up to this, each time exploring confirms the same k
    baseline_every: int = 50  # steps a k = 0 measurement stays valid
    reprobe_every: int = 20  # steps with speculation off before it is probed again
    reprobe_max: int = 160  # the wait doubles, up to this, while probes keep failing
    # One k per context bucket (<4K, 4-16K, 16-32K, 32-64K, 64K+; areal_npu/speculation/context_k.py):
    # chosen from each bucket's acceptance and draft_cost, applied per batch from its dominant bucket.
    # Needs per-request acceptance from the engines (vLLM 0.32 and later).
    by_context: bool = False
    draft_cost: float = 0.1  # by_context only: one draft position (drafting + verifying it), in decode steps

    def __post_init__(self):
        # the one place k_init is defaulted: two drafts, or fewer where the engine drafts fewer
        if self.k_init is None:
            self.k_init = min(2, self.k_max)

    def validate(self) -> SpecAdaptConfig:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name}: must be finite, got {value}")
        if self.k_min < 1:
            raise ValueError(f"k_min: must be ≥ 1, got {self.k_min}")
        if self.k_max < self.k_min:
            raise ValueError(f"k_max: must be ≥ k_min={self.k_min}, got {self.k_max}")
        if not self.k_min <= self.k_init <= self.k_max:
            raise ValueError(
                f"k_init: must lie in [k_min, k_max] = [{self.k_min}, {self.k_max}], got {self.k_init}"
            )
        if self.explore_max < self.explore_every:
            raise ValueError(
                f"explore_max: must be ≥ explore_every={self.explore_every}, got {self.explore_max}"
            )
        if self.reprobe_max < self.reprobe_every:
            raise ValueError(
                f"reprobe_max: must be ≥ reprobe_every={self.reprobe_every}, got {self.reprobe_max}"
            )
        for name in ("window", "accept_window", "explore_every", "reprobe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be ≥ 1, got {getattr(self, name)}")
        if self.baseline_every < self.window:
            raise ValueError(f"baseline_every: must be ≥ window={self.window}, got {self.baseline_every}")
        for name in ("min_gain", "switch_margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be ≥ 0, got {getattr(self, name)}")
        if self.draft_cost < 0:
            raise ValueError(f"draft_cost: must be ≥ 0, got {self.draft_cost}")
        if not self.by_context and self.draft_cost != SpecAdaptConfig.draft_cost:
            raise ValueError("draft_cost: is only read when by_context is true")
        for name in HILL_CLIMBING_ONLY if self.by_context else ():  # nothing accepted and ignored
            if getattr(self, name) != getattr(SpecAdaptConfig, name):
                raise ValueError(f"{name}: is not read with by_context (one k per bucket on the cost model)")
        for name in ("off_accept", "deep_accept_floor"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must lie in [0, 1], got {getattr(self, name)}")
        return self


#: Settings of the throughput hill climbing that the context-aware policy (``by_context``) does not read.
HILL_CLIMBING_ONLY = (
    "accept_window", "switch_margin", "off_accept", "deep_accept_floor", "explore_every", "explore_max",
    "reprobe_max",
)  # fmt: skip


@dataclass(frozen=True)
class SpecDecision:
    step: int
    k_from: int
    k_to: int
    reason: str


class AdaptiveSpec:
    """Chooses the draft length from per-step observations; see the module docstring for the rules."""

    def __init__(self, config: SpecAdaptConfig | None = None):
        self.config = (config or SpecAdaptConfig()).validate()
        self.k = self.config.k_init
        self.step = 0
        self.decisions: list[SpecDecision] = []
        self._tps: dict[int, deque[tuple[int, float]]] = {}
        self._accept: deque[list[float]] = deque(maxlen=self.config.window)
        self._since_change = 0
        self._hold_until = 0
        self._baseline_probe = False
        self._cap = self.config.k_max
        self._last_good_k = self.config.k_init
        self._incumbent = self.config.k_init
        self._hold = self.config.explore_every
        self._reprobe_wait = self.config.reprobe_every
        self._probing_on = False  # a re-probe is running and has not paid yet

    # -- bookkeeping -------------------------------------------------------------------------------
    def _mean_tps(self, k: int, max_age: int) -> float | None:
        samples = self._tps.get(k)
        if not samples or self.step - samples[-1][0] > max_age:
            return None
        return sum(t for _, t in samples) / len(samples)

    def _decide(self, k_to: int, reason: str) -> SpecDecision:
        if k_to == 0 and self.k > 0 and self._probing_on and not self._baseline_probe:
            self._probing_on = False
            self._reprobe_wait = min(2 * self._reprobe_wait, self.config.reprobe_max)
            reason += f"; next probe in {self._reprobe_wait} steps"
        decision = SpecDecision(self.step, self.k, k_to, reason)
        self._accept.clear()
        self._since_change = 0
        self._hold_until = 0
        self.k = k_to
        self.decisions.append(decision)
        return decision

    # -- the policy --------------------------------------------------------------------------------
    def observe(self, k: int, accept_per_pos: Sequence[float], tokens_per_s: float) -> SpecDecision | None:
        """One step's measurements; returns a decision when the draft length (or on/off state) changes."""
        cfg = self.config
        self.step += 1
        if tokens_per_s > 0 and math.isfinite(tokens_per_s):
            self._tps.setdefault(k, deque(maxlen=cfg.window)).append((self.step, float(tokens_per_s)))
        if k != self.k:
            return None  # the engine still runs an earlier decision: nothing to judge yet
        self._since_change += 1
        if k == 0:
            return self._observe_off()
        u = [float(x) for x in list(accept_per_pos)[:k]]
        self._accept.append(u + [0.0] * (k - len(u)))
        if self._since_change < cfg.accept_window:
            return None
        mean_u = [sum(col) / len(self._accept) for col in zip(*self._accept)]
        rate = sum(mean_u) / k
        if rate < cfg.off_accept:
            return self._decide(
                0,
                f"mean acceptance {rate:.3f} < off_accept {cfg.off_accept} at k={k}: drafts are "
                "rejected, speculation costs more than it saves; off",
            )
        deep = mean_u[-1] / mean_u[-2] if k > 1 and mean_u[-2] > 0 else mean_u[-1]
        if k > cfg.k_min and deep < cfg.deep_accept_floor:
            self._cap = k - 1
            return self._decide(
                k - 1,
                f"acceptance of draft position {k} is {deep:.3f} < deep_accept_floor "
                f"{cfg.deep_accept_floor}: k {k} → {k - 1}",
            )
        if self._since_change < cfg.window or self.step < self._hold_until:
            return None
        return self._search()

    def _observe_off(self) -> SpecDecision | None:
        cfg = self.config
        if self._baseline_probe:
            if self._since_change < cfg.window:
                return None
            self._baseline_probe = False
            base = self._mean_tps(0, cfg.baseline_every)
            on = {
                kk: self._mean_tps(kk, cfg.explore_every + 2 * cfg.window) for kk in range(1, cfg.k_max + 1)
            }
            on = {kk: t for kk, t in on.items() if t is not None}
            best = max(on, key=on.get) if on else None
            if best is not None and on[best] >= base * (1 + cfg.min_gain):
                self._incumbent = best
                decision = self._decide(
                    best,
                    f"k=0 baseline {base:.1f} tok/s; k={best} gives {on[best]:.1f} tok/s "
                    f"(+{on[best] / base - 1:.1%}): back to k={best}",
                )
                self._hold_until = self.step + self._hold
                return decision
            gain = f"+{on[best] / base - 1:.1%} at k={best}" if best is not None else "nothing measured"
            return self._decide(0, f"speculation off: {gain} over k=0 is below min_gain {cfg.min_gain:.0%}")
        if self._since_change >= self._reprobe_wait:
            self._cap = cfg.k_max
            self._probing_on = True
            probe = max(cfg.k_min, min(self._last_good_k, cfg.k_max))
            self._incumbent = probe
            return self._decide(
                probe, f"re-probing speculation at k={probe} after {self._since_change} steps off"
            )
        return None

    def _search(self) -> SpecDecision | None:
        cfg = self.config
        k, fresh_age = self.k, cfg.explore_every + 2 * cfg.window
        top = min(self._cap, cfg.k_max)
        fresh = {kk: self._mean_tps(kk, fresh_age) for kk in range(cfg.k_min, top + 1)}
        fresh = {kk: t for kk, t in fresh.items() if t is not None}
        if k not in fresh:
            return None  # no usable throughput at this k yet
        # The incumbent (the k held before a probe) keeps its place unless another k beats it by
        # switch_margin: a probe that is only as good goes back, noise does not make k wander.
        incumbent = self._incumbent if self._incumbent in fresh else k
        best = max(fresh, key=fresh.get)
        target = best if fresh[best] > fresh[incumbent] * (1 + cfg.switch_margin) else incumbent
        if target != k:
            if target == incumbent:
                reason = (
                    f"probe k={k} gives {fresh[k]:.1f} tok/s, not {cfg.switch_margin:.0%} above "
                    f"{fresh[target]:.1f} at k={target}: back to k={target}"
                )
            else:
                reason = (
                    f"k={target} gives {fresh[target]:.1f} tok/s vs {fresh[k]:.1f} at k={k} "
                    f"({fresh[target] / fresh[k] - 1:+.1%})"
                )
            self._incumbent = target
            return self._decide(target, reason)
        self._incumbent = k
        here = fresh[k]
        for kk in (k + 1, k - 1):
            if cfg.k_min <= kk <= top and kk not in fresh:
                return self._decide(kk, f"probing k={kk} (neighbour of k={k}, no recent measurement)")
        base = self._mean_tps(0, cfg.baseline_every)
        if base is None:
            self._baseline_probe = True
            return self._decide(0, f"probing k=0 for the autoregressive baseline (holding k={k})")
        if here < base * (1 + cfg.min_gain):
            return self._decide(
                0,
                f"speculation no longer pays: k={k} gives {here:.1f} tok/s vs {base:.1f} at k=0 "
                f"({here / base - 1:+.1%} < min_gain {cfg.min_gain:.0%}); off",
            )
        self._hold = min(2 * self._hold, cfg.explore_max) if self._last_good_k == k else cfg.explore_every
        self._probing_on = False
        self._reprobe_wait = cfg.reprobe_every  # speculation pays again: probe promptly next time
        self._last_good_k = k
        self._hold_until = self.step + self._hold
        self._cap = cfg.k_max  # the next exploration may go deeper again (the drafter keeps training)
        return None
