"""Step-time model, acceptance formulas and cost calibration against hand-worked and published numbers."""

import math
import random

import numpy as np
import pytest

from areal_npu.speculation import planner as pl
from areal_npu.speculation.acceptance import SpecCounters, spec_stats
from areal_npu.speculation.cost import (
    CostModel,
    StepSample,
    calibrate,
    draft_cost_from_speedup,
    recommend_k,
    relative_cost_model,
    sweep,
)

# Published NeMo-RL numbers, Qwen3-8B, k = 3 EAGLE-3 draft, synchronous RL: AR → speculative seconds.
RL_ZERO = dict(
    phases=dict(data=0.2, prepare=1.9, gen=100.0, prox=17.8, train=31.3), gen_spec=56.6, step_spec=107.5
)
RL_THINK = dict(
    phases=dict(data=0.3, prepare=2.1, gen=133.6, prox=17.9, train=31.4), gen_spec=87.0, step_spec=137.4
)


def test_hand_worked_bound():
    # Half the step is generation, generation twice as fast: 1 / (0.5/2 + 0.5) = 4/3.
    assert pl.step_speedup(0.5, 2.0) == pytest.approx(4 / 3)
    assert pl.step_speedup(0.0, 10.0) == 1.0 and pl.step_speedup(1.0, 3.0) == pytest.approx(3.0)
    assert pl.step_speedup_ceiling(0.75) == pytest.approx(4.0)
    assert pl.step_speedup_ceiling(1.0) == math.inf
    assert pl.speculative_step_time(150.0, 100.0, 2.0) == 100.0


@pytest.mark.parametrize("run", [RL_ZERO, RL_THINK], ids=["rl_zero_1.41x", "rl_think_1.35x"])
def test_published_step_speedup_within_2_percent(run):
    t_step = pl.step_time(run["phases"])
    assert t_step == pytest.approx(151.2 if run is RL_ZERO else 185.3)
    a = run["phases"]["gen"] / run["gen_spec"]
    predicted = pl.step_speedup(pl.gen_fraction(run["phases"]["gen"], t_step), a)
    measured = t_step / run["step_spec"]
    assert predicted == pytest.approx(measured, rel=0.02)
    assert predicted == pytest.approx(1.41 if run is RL_ZERO else 1.35, rel=0.02)


def test_gen_fraction_rejects_impossible_times():
    with pytest.raises(ValueError, match="^t_gen"):
        pl.gen_fraction(200.0, 100.0)
    with pytest.raises(ValueError, match="^t_step"):
        pl.gen_fraction(1.0, 0.0)


def test_accepted_length_hand_worked():
    # k = 2, p = 0.5: 1 + 0.5 + 0.25.
    assert pl.expected_accepted_length_iid(0.5, 2) == pytest.approx(1.75)
    assert pl.expected_accepted_length_iid(1.0, 3) == 4.0
    assert pl.expected_accepted_length_iid(0.0, 5) == 1.0
    # Conditional 0.9, 0.5, 0.2: 1 + 0.9 + 0.45 + 0.09.
    assert pl.expected_accepted_length([0.9, 0.5, 0.2]) == pytest.approx(2.44)
    assert pl.expected_accepted_length([0.9, 0.5, 0.2], k=1) == pytest.approx(1.9)
    # Deeper than measured: the last conditional value repeats.
    assert pl.expected_accepted_length([0.8], k=3) == pytest.approx(pl.expected_accepted_length_iid(0.8, 3))


@pytest.mark.parametrize("p", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_iid_closed_form_equals_general_sum(p, k):
    assert pl.expected_accepted_length_iid(p, k) == pytest.approx(pl.expected_accepted_length([p] * k))


def test_accepted_length_matches_monte_carlo():
    """Simulate the verifier: draft i survives with p_i given 1..i-1 survived; one bonus token always."""
    rng = random.Random(1234)
    cond = [0.92, 0.75, 0.5, 0.3]
    n = 40_000
    lengths = []
    for _ in range(n):
        accepted = 0
        for p in cond:
            if rng.random() >= p:
                break
            accepted += 1
        lengths.append(1 + accepted)
    mean, sd = np.mean(lengths), np.std(lengths)
    # 5 standard errors: fails by chance with probability < 1e-6.
    assert abs(mean - pl.expected_accepted_length(cond)) < 5 * sd / math.sqrt(n)
    # The per-position counters vLLM keeps, divided by drafts, are the unconditional rates.
    per_pos = [np.mean([length > i + 1 for length in lengths]) for i in range(len(cond))]
    np.testing.assert_allclose(per_pos, pl.unconditional_from_conditional(cond), atol=0.01)
    np.testing.assert_allclose(pl.conditional_from_unconditional(per_pos), cond, atol=0.02)


def test_iid_accept_from_rate_inverts():
    for p, k in [(0.6, 3), (0.2, 1), (0.9, 5)]:
        rate = (pl.expected_accepted_length_iid(p, k) - 1) / k
        assert pl.iid_accept_from_rate(rate, k) == pytest.approx(p, abs=1e-9)


def test_live_perf_metrics():
    timings = {"timing/gen_s": 60.0, "timing/train_s": 30.0, "timing/prox_s": 10.0}
    off = pl.live_perf_metrics(timings)
    assert off["perf/gen_fraction"] == pytest.approx(0.6)
    assert off["rollout/spec_k"] == 0 and off["perf/step_speedup_bound"] == pytest.approx(1.0)
    assert off["perf/step_speedup_ceiling"] == pytest.approx(2.5)
    # k = 3, 2 accepted tokens per verify step (α = 3), explicit step time 100 s; the acceptance
    # metrics as the step logs them (the acceptance tracker's keys, read as written).
    acceptance = spec_stats(SpecCounters(drafts=10, draft_tokens=30, accepted=20, time=1.0))
    on = pl.live_perf_metrics(timings | {"timing/step_s": 100.0} | acceptance)
    assert on["rollout/spec_k"] == 3
    # Autoregressive would have taken ≤ 3·60 = 180 s of generation: step ≤ 220 s → bound 2.2.
    assert on["perf/step_speedup_bound"] == pytest.approx(2.2)
    assert on["perf/step_speedup_ceiling"] == pytest.approx(220 / 40)


def test_calibration_recovers_known_parameters():
    truth = CostModel(v0=0.020, v1=0.0004, d0=0.003, d1=0.00005)
    rng = np.random.default_rng(0)
    samples = []
    for b in (8, 32, 64, 128):
        for k in (0, 1, 2, 3, 4):
            length = pl.expected_accepted_length([0.8, 0.6, 0.5, 0.4], k) if k else 1.0
            tps = truth.tokens_per_s(b, k, length) * (1 + rng.normal(0, 0.002))
            samples.append(StepSample.from_throughput(b, k, length, tps))
    fit = calibrate(samples)
    for name in ("v0", "v1", "d0", "d1"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def test_calibration_single_batch_and_single_k():
    # One batch size: batch terms fold into the constants; predictions at that batch are exact.
    truth = CostModel(v0=0.05, v1=0.001, d0=0.004, d1=0.0002)
    samples = [StepSample(32, k, truth.step_time(32, k)) for k in (0, 2, 3)]
    fit = calibrate(samples)
    for k in range(6):
        assert fit.step_time(32, k) == pytest.approx(truth.step_time(32, k))
    # One draft length: the relative draft cost must come from elsewhere.
    with pytest.raises(ValueError, match="^draft_cost"):
        calibrate([StepSample(32, 3, 0.1)])
    fit = calibrate([StepSample(32, 3, 0.13)], draft_cost=0.1)
    assert fit.ar_step_time(32) == pytest.approx(0.1) and fit.draft_cost(32) == pytest.approx(0.01)


def test_sweep_reproduces_the_measured_point_and_the_papers_k_trend():
    phases = RL_ZERO["phases"]
    t_step = pl.step_time(phases)
    a3 = phases["gen"] / RL_ZERO["gen_spec"]
    accept = [0.6]
    r = draft_cost_from_speedup(pl.expected_accepted_length(accept, 3), a3, 3)
    rows = sweep(phases["gen"], t_step, accept, relative_cost_model(r))
    by_k = {row.k: row for row in rows}
    assert by_k[0].step_speedup == 1.0 and by_k[0].t_step == pytest.approx(t_step)
    assert by_k[3].gen_speedup == pytest.approx(a3)
    assert by_k[3].t_gen == pytest.approx(56.6)
    assert by_k[3].step_speedup == pytest.approx(151.2 / 107.5, rel=0.02)
    # The paper: k = 5 and k = 7 were worse than k = 3.
    assert by_k[5].step_speedup < by_k[3].step_speedup and by_k[7].step_speedup < by_k[3].step_speedup
    assert recommend_k(rows) == 3


def test_recommend_k_turns_speculation_off_when_it_does_not_pay():
    rows = sweep(100.0, 150.0, [0.05], relative_cost_model(0.2))
    assert all(row.step_speedup < 1.0 for row in rows if row.k)
    assert recommend_k(rows) == 0


def test_draft_cost_from_speedup_rejects_inconsistent_numbers():
    with pytest.raises(ValueError, match="^gen_speedup"):
        draft_cost_from_speedup(accepted_len=1.5, gen_speedup=2.0, k=3)


def test_a_name_that_is_not_a_phase_is_refused_not_counted_as_zero():
    # NeMo-RL calls the proximal log-prob phase "logprob"; here it is "prox": the sum must not drop it
    assert pl.step_time({"gen": 6.0, "prox": 2.0, "train": 2.0}) == 10.0
    with pytest.raises(ValueError, match="logprob"):
        pl.step_time({"gen": 6.0, "logprob": 2.0, "train": 2.0})
