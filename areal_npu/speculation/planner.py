"""Step-time model for speculative rollouts: where a step's time goes and what speculation can buy.

A training step, as NeMo-RL decomposes it (plus the weight sync an asynchronous run pays; the phases
are :data:`areal_npu.names.PHASES`, ``prox`` being NeMo-RL's "logprob")::

    T_step = T_data + T_prepare + T_gen + T_prox + T_train (+ T_sync)

Speculation shortens only ``T_gen``, by the generation speed-up ``a``. With
``R_gen = T_gen / T_step`` (autoregressive times) the step becomes
``T_step - T_gen + T_gen / a``, so (Amdahl)::

    S_step = 1 / (R_gen / a + (1 - R_gen))   ≤   1 / (1 - R_gen)  (the ceiling, a → ∞)

It is a bound because ``a`` is the best the rollout phase delivers; every other phase is unchanged.
Phases may overlap in an asynchronous run: there ``T_gen`` must be the time the step waits for
rollouts, not the engine's busy time.

Acceptance. A chain drafter proposes k tokens; the verifier accepts a prefix of them and always adds
one token of its own. With conditional per-position acceptance
``p_i = P(draft i accepted | drafts 1..i-1 accepted)`` the expected tokens per verify step are::

    E[L_k] = 1 + Σ_{i=1..k} Π_{j≤i} p_j        (iid p:  (1 - p^(k+1)) / (1 - p),  k + 1 at p = 1)

vLLM counts ``spec_decode_num_accepted_tokens_per_pos[i]``: verify steps whose draft i+1 was
accepted; divided by ``spec_decode_num_drafts`` these are the *unconditional* rates
``u_i = Π_{j≤i} p_j`` (``rollout/spec_accept_rate_pos<i>`` in metrics.jsonl), so ``E[L_k] = 1 + Σ u_i``.

The cost of drafting and verifying (what turns accepted length into a speed-up) lives in
:mod:`areal_npu.speculation.cost`; the adaptive draft-length policy in :mod:`areal_npu.speculation.policy`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from areal_npu import names


def step_time(phases: Mapping[str, float]) -> float:
    """``T_step = Σ_phase T_phase`` over :data:`~areal_npu.names.PHASES` given (missing phases count 0);
    a name that is not a phase raises (NeMo-RL's ``logprob`` is ``prox`` here), rather than counting 0."""
    unknown = sorted(set(phases) - set(names.PHASES))
    if unknown:
        raise ValueError(f"phases: {unknown} are not phases; the phases are {', '.join(names.PHASES)}")
    return float(sum(float(phases.get(p, 0.0)) for p in names.PHASES))


def gen_fraction(t_gen: float, t_step: float) -> float:
    """``R_gen = T_gen / T_step``; raises when ``T_gen`` exceeds ``T_step`` or ``T_step ≤ 0``."""
    if t_step <= 0:
        raise ValueError(f"t_step: must be > 0, got {t_step}")
    if not 0 <= t_gen <= t_step * (1 + 1e-9):
        raise ValueError(f"t_gen: must lie in [0, t_step={t_step}], got {t_gen}")
    return min(t_gen / t_step, 1.0)


def step_speedup(r_gen: float, gen_speedup: float) -> float:
    """``S_step = 1 / (R_gen / a + (1 - R_gen))``: the step speed-up when generation runs ``a``× faster."""
    if not 0 <= r_gen <= 1:
        raise ValueError(f"r_gen: must lie in [0, 1], got {r_gen}")
    if gen_speedup <= 0:
        raise ValueError(f"gen_speedup: must be > 0, got {gen_speedup}")
    return 1.0 / (r_gen / gen_speedup + (1.0 - r_gen))


def step_speedup_ceiling(r_gen: float) -> float:
    """``lim_{a→∞} S_step = 1 / (1 - R_gen)`` (infinite when the step is all generation)."""
    if not 0 <= r_gen <= 1:
        raise ValueError(f"r_gen: must lie in [0, 1], got {r_gen}")
    return math.inf if r_gen >= 1 else 1.0 / (1.0 - r_gen)


def speculative_step_time(t_step: float, t_gen: float, gen_speedup: float) -> float:
    """``T_step' = T_step - T_gen + T_gen / a`` (autoregressive times in, speculative step out)."""
    return t_step - t_gen + t_gen / gen_speedup


def _check_probs(probs: Sequence[float], name: str) -> list[float]:
    out = [float(p) for p in probs]
    for p in out:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name}: acceptance probabilities must lie in [0, 1], got {p}")
    return out


def extend_acceptance(conditional: Sequence[float], k: int) -> list[float]:
    """Conditional acceptance for positions 1..k: measured prefix, then the last measured value repeated.

    Later draft positions are rarely better than earlier ones, so repeating the deepest measured
    position is the optimistic-but-not-wild extrapolation; an empty profile means nothing is accepted.
    """
    probs = _check_probs(conditional, "conditional")
    if k <= len(probs):
        return probs[:k]
    fill = probs[-1] if probs else 0.0
    return probs + [fill] * (k - len(probs))


def expected_accepted_length(conditional: Sequence[float], k: int | None = None) -> float:
    """``E[L_k] = 1 + Σ_{i=1..k} Π_{j≤i} p_j``: tokens per verify step (k defaults to the profile's length)."""
    k = len(conditional) if k is None else k
    if k < 0:
        raise ValueError(f"k: must be ≥ 0, got {k}")
    total, survive = 1.0, 1.0
    for p in extend_acceptance(conditional, k):
        survive *= p
        total += survive
    return total


def expected_accepted_length_iid(p: float, k: int) -> float:
    """``E[L_k] = (1 - p^(k+1)) / (1 - p)`` for iid acceptance p (``k + 1`` at p = 1)."""
    _check_probs([p], "p")
    if k < 0:
        raise ValueError(f"k: must be ≥ 0, got {k}")
    if p >= 1.0:
        return float(k + 1)
    return (1.0 - p ** (k + 1)) / (1.0 - p)


def conditional_from_unconditional(per_pos: Sequence[float]) -> list[float]:
    """``p_i = u_i / u_{i-1}`` (``u_0 = 1``) from vLLM-style per-position rates; 0 after a zero rate."""
    u = _check_probs(per_pos, "per_pos")
    out, prev = [], 1.0
    for ui in u:
        out.append(min(ui / prev, 1.0) if prev > 0 else 0.0)
        prev = ui
    return out


def unconditional_from_conditional(conditional: Sequence[float]) -> list[float]:
    """``u_i = Π_{j≤i} p_j``."""
    out, survive = [], 1.0
    for p in _check_probs(conditional, "conditional"):
        survive *= p
        out.append(survive)
    return out


def iid_accept_from_rate(rate: float, k: int) -> float:
    """The iid p whose accepted fraction ``(E[L_k] - 1) / k = Σ_{i=1..k} p^i / k`` equals ``rate``.

    Used when a run logged only ``rollout/spec_accept_rate`` (accepted / drafted); the left side is
    increasing in p, so bisection finds the unique root.
    """
    _check_probs([rate], "rate")
    if k < 1:
        raise ValueError(f"k: must be ≥ 1, got {k}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if (expected_accepted_length_iid(mid, k) - 1.0) / k < rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def live_perf_metrics(stats: Mapping[str, float], spec_k: int | None = None) -> dict[str, float]:
    """Per-step speculation health from one step's stats: timings (``timing/<phase>_s``,
    ``timing/step_s``) and, with speculation on, the step's acceptance metrics as
    :func:`areal_npu.speculation.acceptance.spec_stats` writes them.

    Returns ``perf/gen_fraction`` (``T_gen / T_step`` as measured), ``rollout/spec_k`` (``spec_k``,
    else ``draft tokens / drafts``), ``perf/step_speedup_bound`` and ``perf/step_speedup_ceiling``.
    The bound is what this step can have gained over autoregressive decoding given the accepted length
    α (``rollout/spec_mean_accepted_len``; 1 with speculation off), draft and verification cost taken as
    free: the autoregressive generation time is at most ``α·T_gen``, so with the rebased
    ``R_ar = α·T_gen / (T_step + (α-1)·T_gen)`` it is ``1/(R_ar/α + 1 - R_ar) = 1 + (α-1)·R_gen``.
    The ceiling ``1/(1 - R_ar)`` is what any generation speed-up could give.
    """
    t_gen = float(stats.get(names.timing_key("gen"), 0.0))
    t_step = stats.get(names.STEP_TIME)
    if t_step is None:
        t_step = step_time({p: stats.get(names.timing_key(p), 0.0) for p in names.PHASES})
    t_step = float(t_step)
    r_gen = gen_fraction(t_gen, t_step)
    alpha, k = 1.0, int(spec_k or 0)
    drafts = float(stats.get(names.SPEC_DRAFTS, 0.0))
    if drafts > 0:
        alpha = float(stats.get(names.SPEC_MEAN_ACCEPTED_LEN, 1.0))
        if spec_k is None:
            k = round(float(stats.get(names.SPEC_DRAFT_TOKENS, 0.0)) / drafts)
    t_gen_ar = alpha * t_gen
    r_ar = t_gen_ar / (t_step - t_gen + t_gen_ar) if t_step > 0 else 0.0
    return {
        names.GEN_FRACTION: r_gen,
        names.SPEC_K: float(k),
        names.STEP_SPEEDUP_BOUND: step_speedup(r_ar, alpha),
        names.STEP_SPEEDUP_CEILING: step_speedup_ceiling(r_ar),
    }
