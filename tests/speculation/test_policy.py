"""The adaptive draft-length policy on simulated engines whose best k is known in closed form."""

import random
from collections import Counter

import pytest

from areal_npu.speculation.planner import (
    expected_accepted_length,
    extend_acceptance,
    unconditional_from_conditional,
)
from areal_npu.speculation.policy import AdaptiveSpec, SpecAdaptConfig


class SimEngine:
    """tokens/s(k) = B·E[L_k] / (t_ar·(1 + r·k)) with multiplicative noise; acceptance as vLLM counts it."""

    def __init__(self, conditional, draft_cost=0.15, noise=0.01, seed=0):
        self.conditional, self.draft_cost, self.noise = conditional, draft_cost, noise
        self.rng = random.Random(seed)

    def true_tps(self, k):
        length = expected_accepted_length(self.conditional, k) if k else 1.0
        return 1000.0 * length / (1.0 + self.draft_cost * k)

    def step(self, k):
        per_pos = unconditional_from_conditional(extend_acceptance(self.conditional, k))
        return per_pos, self.true_tps(k) * (1.0 + self.rng.gauss(0.0, self.noise))


def drive(policy, engine, steps):
    ks, decisions = [], []
    for _ in range(steps):
        k = policy.k
        ks.append(k)
        decision = policy.observe(k, *engine.step(k))
        if decision:
            decisions.append(decision)
    return ks, decisions


def test_good_drafter_keeps_speculation_and_settles_on_the_best_k():
    engine = SimEngine([0.9, 0.8, 0.3, 0.1])
    best = max(range(0, 5), key=engine.true_tps)
    assert best == 2  # by construction: 1.65×, 2.02×, 1.96×, 1.79× for k = 1..4
    policy = AdaptiveSpec(SpecAdaptConfig(k_max=4, k_init=1))
    ks, decisions = drive(policy, engine, 150)
    assert all(d.reason for d in decisions)
    assert not any(d.k_to == 0 and "off" in d.reason for d in decisions)
    assert Counter(ks[-60:]).most_common(1)[0][0] == best
    assert Counter(ks[-60:])[best] >= 45  # exploration costs little once settled
    assert policy.k == best


def test_random_drafter_is_switched_off_fast_and_reprobed():
    cfg = SpecAdaptConfig(k_init=2, window=3, reprobe_every=20)
    engine = SimEngine([0.01], draft_cost=0.15)
    policy = AdaptiveSpec(cfg)
    ks, decisions = drive(policy, engine, 100)
    first_off = ks.index(0)
    assert first_off == cfg.accept_window  # acceptance is judged after one step, not a whole window
    assert "acceptance" in decisions[0].reason and decisions[0].k_to == 0
    probes = [d for d in decisions if d.k_from == 0 and d.k_to > 0]
    assert probes and "re-probing" in probes[0].reason
    assert probes[0].step == first_off + cfg.reprobe_every
    # a failed probe doubles the wait before the next one
    assert len(probes) >= 2 and probes[1].step - probes[0].step == 2 * cfg.reprobe_every + cfg.accept_window
    # Each probe ends off again within a window; most steps run autoregressive.
    assert ks.count(0) >= 0.8 * len(ks)
    assert policy.k == 0 or policy.step - probes[-1].step < cfg.window


def test_acceptance_drop_lowers_k():
    engine = SimEngine([0.95, 0.9, 0.85, 0.8], draft_cost=0.05)
    policy = AdaptiveSpec(SpecAdaptConfig(k_max=4, k_init=4))
    drive(policy, engine, 30)
    assert policy.k >= 3
    engine.conditional = [0.8, 0.1, 0.1, 0.1]  # the policy moved on: deep drafts now rejected
    _, decisions = drive(policy, engine, 30)
    lowered = [d for d in decisions if d.k_to < d.k_from and "acceptance" in d.reason]
    assert lowered, decisions
    assert policy.k == 1


def test_speculation_that_does_not_pay_is_turned_off():
    # Drafts accepted (0.3) but too expensive (r = 0.5): every k > 0 is slower than k = 0.
    engine = SimEngine([0.3], draft_cost=0.5)
    assert all(engine.true_tps(k) < engine.true_tps(0) for k in range(1, 5))
    policy = AdaptiveSpec(SpecAdaptConfig(k_init=2, reprobe_every=200, reprobe_max=200))
    ks, decisions = drive(policy, engine, 40)
    assert ks[-10:] == [0] * 10
    assert any("min_gain" in d.reason for d in decisions)


@pytest.mark.parametrize(
    "field,value",
    [("k_min", 0), ("k_max", 0), ("k_init", 9), ("window", 0), ("min_gain", -0.1), ("off_accept", 1.5),
     ("deep_accept_floor", -1.0), ("baseline_every", 1), ("explore_max", 1), ("reprobe_every", 0),
     ("accept_window", 0), ("reprobe_max", 1)],
)  # fmt: skip
def test_config_validation_names_the_field(field, value):
    cfg = SpecAdaptConfig(**{field: value})
    with pytest.raises(ValueError, match=f"^{field}:"):
        cfg.validate()
