"""What a verify step costs, calibrated from measurements, and the k sweep built on it.

Cost model (seconds per engine step at running batch b and draft length k)::

    t(b, k) = c_verify(b, k) + k · c_draft(b)
    c_verify(b, k) = v0 + v1·b + k·b·e          autoregressive step: t(b, 0) = v0 + v1·b
    c_draft(b)     = d0 + d1'·b

Only ``d1 = d1' + e`` (the per-sequence cost of one more draft position: drafting it and verifying
it) can be told apart from timings, so the model carries ``(v0, v1, d0, d1)``::

    t(b, k) = v0 + v1·b + k·(d0 + d1·b)

Tokens per second and generation speed-up follow from the expected accepted length ``E[L_k]``::

    tokens/s(b, k) = b · E[L_k] / t(b, k)        a(b, k) = E[L_k] · t(b, 0) / t(b, k)

Over a mix of context buckets (shares ``w_b`` of the generated tokens, acceptance per bucket:
``rollout/spec_ctx_*``) one k gives ``E_mix[L_k] = 1 / Σ_b w_b / E_b[L_k]`` and one k per bucket
the generation speed-up ``1 / Σ_b w_b · (t(b, k_b) / t(b, 0)) / E_b[L_{k_b}]`` (:func:`context_sweep`).

The parameters are fitted by least squares to measured step times ``t = b · E[L_k] / tokens/s``; a
coefficient the data cannot identify (one batch size, one draft length) is left out of the fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from areal_npu.speculation.planner import expected_accepted_length, speculative_step_time, step_speedup


@dataclass(frozen=True)
class CostModel:
    """``t(b, k) = v0 + v1·b + k·(d0 + d1·b)`` seconds per engine step (see the module docstring)."""

    v0: float
    v1: float = 0.0
    d0: float = 0.0
    d1: float = 0.0

    def ar_step_time(self, batch: float) -> float:
        """``t(b, 0) = v0 + v1·b``."""
        return self.v0 + self.v1 * batch

    def draft_cost(self, batch: float) -> float:
        """``d0 + d1·b``: seconds one more draft position adds (drafting plus verifying it)."""
        return self.d0 + self.d1 * batch

    def step_time(self, batch: float, k: int) -> float:
        return self.ar_step_time(batch) + k * self.draft_cost(batch)

    def gen_speedup(self, batch: float, k: int, accepted_len: float) -> float:
        """``a = E[L_k] · t(b, 0) / t(b, k)``."""
        return accepted_len * self.ar_step_time(batch) / self.step_time(batch, k)

    def tokens_per_s(self, batch: float, k: int, accepted_len: float) -> float:
        return batch * accepted_len / self.step_time(batch, k)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def relative_cost_model(draft_cost: float) -> CostModel:
    """Batch-free model in units of one autoregressive step: ``t(k) = 1 + r·k``, r = ``draft_cost``."""
    if draft_cost < 0:
        raise ValueError(f"draft_cost: must be ≥ 0, got {draft_cost}")
    return CostModel(v0=1.0, d0=draft_cost)


def draft_cost_from_speedup(accepted_len: float, gen_speedup: float, k: int) -> float:
    """Relative draft cost r from one measured point: ``a = E[L_k] / (1 + r·k)`` ⇒ ``r = (E[L_k]/a - 1)/k``."""
    if k < 1 or gen_speedup <= 0:
        raise ValueError(f"k: need k ≥ 1 and gen_speedup > 0, got k={k}, gen_speedup={gen_speedup}")
    r = (accepted_len / gen_speedup - 1.0) / k
    if r < 0:
        raise ValueError(
            f"gen_speedup: {gen_speedup:.3f} exceeds the accepted length {accepted_len:.3f} at k={k}; "
            "the acceptance given is too low for the speed-up measured"
        )
    return r


@dataclass(frozen=True)
class StepSample:
    """One measurement: running batch, draft length, seconds per engine step."""

    batch: float
    k: int
    seconds: float

    @classmethod
    def from_throughput(cls, batch: float, k: int, accepted_len: float, tokens_per_s: float) -> StepSample:
        """``t = b · E[L_k] / tokens/s`` (each engine step yields ``E[L_k]`` tokens per sequence)."""
        if tokens_per_s <= 0 or batch <= 0:
            raise ValueError(
                f"tokens_per_s: need tokens_per_s > 0 and batch > 0, got {tokens_per_s}, {batch}"
            )
        return cls(float(batch), int(k), float(batch) * float(accepted_len) / float(tokens_per_s))


def _lstsq_nonneg(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with θ ≥ 0: drop the most negative coefficient and refit (costs are never negative)."""
    active = list(range(features.shape[1]))
    theta = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        if (sol >= 0).all():
            theta[active] = sol
            return theta
        active.pop(int(np.argmin(sol)))
    return theta


def calibrate(samples: Iterable[StepSample], draft_cost: float | None = None) -> CostModel:
    """Least-squares fit of ``t(b, k) = v0 + v1·b + k·(d0 + d1·b)`` to measured step times.

    Identifiability decides the features: ``b`` terms need two batch sizes, ``k`` terms two draft
    lengths (a run's k = 0 probes count). With a single draft length the relative ``draft_cost`` r
    (one draft position in units of the autoregressive step) must be given: ``t = t(b, 0)·(1 + r·k)``.
    """
    rows = list(samples)
    if not rows:
        raise ValueError("samples: need at least one measurement")
    b = np.array([s.batch for s in rows], dtype=float)
    k = np.array([s.k for s in rows], dtype=float)
    t = np.array([s.seconds for s in rows], dtype=float)
    many_b, many_k = len(set(b.tolist())) > 1, len(set(k.tolist())) > 1
    if not many_k:
        if draft_cost is None:
            raise ValueError(
                f"draft_cost: measurements hold one draft length (k={int(k[0])}); give the relative "
                "draft cost or measure a second k (k=0 steps will do)"
            )
        ar = t / (1.0 + draft_cost * k)
        cols = [np.ones_like(b)] + ([b] if many_b else [])
        theta = _lstsq_nonneg(np.stack(cols, axis=1), ar)
        v0, v1 = float(theta[0]), float(theta[1]) if many_b else 0.0
        return CostModel(v0=v0, v1=v1, d0=draft_cost * v0, d1=draft_cost * v1)
    names = ["v0", "d0"] + (["v1", "d1"] if many_b else [])
    cols = {"v0": np.ones_like(b), "v1": b, "d0": k, "d1": k * b}
    theta = _lstsq_nonneg(np.stack([cols[n] for n in names], axis=1), t)
    return CostModel(**{n: float(v) for n, v in zip(names, theta)})


@dataclass(frozen=True)
class SweepRow:
    k: int
    accepted_len: float
    gen_speedup: float
    t_gen: float
    t_step: float
    step_speedup: float


def sweep(
    t_gen_ar: float,
    t_step_ar: float,
    conditional_accept: Sequence[float],
    cost: CostModel,
    batch: float = 1.0,
    ks: Iterable[int] = range(9),
) -> list[SweepRow]:
    """Predicted generation and step speed-up (over autoregressive decoding) for each draft length k.

    ``a(k) = E[L_k]·t(b,0)/t(b,k)``; ``T_gen(k) = T_gen/a(k)``; ``S_step(k) = 1/(R_gen/a(k) + 1 - R_gen)``.
    """
    lengths = {kk: expected_accepted_length(conditional_accept, kk) if kk else 1.0 for kk in ks}
    return [
        _row(t_gen_ar, t_step_ar, kk, length, cost.gen_speedup(batch, kk, length))
        for kk, length in lengths.items()
    ]


def _row(t_gen_ar: float, t_step_ar: float, k: int, length: float, a: float) -> SweepRow:
    t_step = speculative_step_time(t_step_ar, t_gen_ar, a)
    return SweepRow(k, length, a, t_gen_ar / a, t_step, step_speedup(t_gen_ar / t_step_ar, a))


def mixed_accepted_length(
    accept_by_bucket: Mapping[str, Sequence[float]], mix: Mapping[str, float], k: int
) -> float:
    """Tokens per verify step over a mix of context buckets at one k: ``1 / Σ_b w_b / E_b[L_k]``
    (``w_b``: the bucket's share of the generated tokens, which take ``w_b / E_b[L_k]`` of the verify
    steps; ``accept_by_bucket``: conditional acceptance per position)."""
    shares = _shares(accept_by_bucket, mix)
    if k == 0:
        return 1.0
    return 1.0 / sum(w / expected_accepted_length(accept_by_bucket[b], k) for b, w in shares.items())


def _shares(accept_by_bucket: Mapping[str, Sequence[float]], mix: Mapping[str, float]) -> dict[str, float]:
    total = sum(mix.values())
    if total <= 0 or any(w < 0 for w in mix.values()):
        raise ValueError(f"context_mix: shares must be ≥ 0 with a positive sum, got {dict(mix)}")
    missing = sorted(b for b, w in mix.items() if w > 0 and b not in accept_by_bucket)
    if missing:
        raise ValueError(f"accept_by_context: no acceptance for the buckets {missing} of the context mix")
    return {b: w / total for b, w in mix.items() if w > 0}


@dataclass(frozen=True)
class ContextSweep:
    rows: list[SweepRow]  # one k for the whole mix, k by k
    k_by_bucket: dict[str, int]  # one k per bucket (each bucket's own recommend_k) ...
    aware: SweepRow  # ... and the step it gives (k: the token-weighted mean k, rounded)


def context_sweep(
    t_gen_ar: float,
    t_step_ar: float,
    accept_by_bucket: Mapping[str, Sequence[float]],
    mix: Mapping[str, float],
    cost: CostModel,
    batch: float = 1.0,
    ks: Iterable[int] = range(9),
    min_gain: float = 0.02,
) -> ContextSweep:
    """:func:`sweep` over a mix of context buckets: one k for all (:func:`mixed_accepted_length`), and
    one k per bucket, whose generation time is ``Σ_b w_b · t(b, k_b) / (t(b, 0) · E_b[L_{k_b}])`` of the
    autoregressive one."""
    shares, ks = _shares(accept_by_bucket, mix), list(ks)
    rows = []
    for kk in ks:
        length = mixed_accepted_length(accept_by_bucket, mix, kk)
        rows.append(_row(t_gen_ar, t_step_ar, kk, length, cost.gen_speedup(batch, kk, length)))
    chosen = {
        b: recommend_k(sweep(t_gen_ar, t_step_ar, accept_by_bucket[b], cost, batch, ks), min_gain)
        for b in shares
    }

    def length(b: str) -> float:
        return expected_accepted_length(accept_by_bucket[b], chosen[b]) if chosen[b] else 1.0

    rel = sum(
        w * cost.step_time(batch, chosen[b]) / cost.ar_step_time(batch) / length(b) for b, w in shares.items()
    )
    mean_k = round(sum(w * chosen[b] for b, w in shares.items()))
    mixed = 1.0 / sum(w / length(b) for b, w in shares.items())
    return ContextSweep(rows, chosen, _row(t_gen_ar, t_step_ar, mean_k, mixed, 1.0 / rel))


def recommend_k(rows: Sequence[SweepRow], min_gain: float = 0.02) -> int:
    """The k with the shortest predicted step; 0 unless it beats autoregressive by ``min_gain``."""
    best = max(rows, key=lambda r: r.step_speedup)
    return best.k if best.k and best.step_speedup >= 1.0 + min_gain else 0
