"""Acceptance by context bucket and context-aware k (no engine): bucketing, per-position / per-bucket
counts against a naive count, the controller's k against a brute-force argmax of the cost model."""

from __future__ import annotations

import asyncio
import random

import pytest

from areal_npu.rollout import request_body
from areal_npu.speculation import context, k_driver
from areal_npu.speculation.adaptive import AdaptiveSpecDriver
from areal_npu.speculation.context_k import ContextAwareK, choose_k
from areal_npu.speculation.policy import SpecAdaptConfig

LABELS = ["lt4k", "4k_16k", "16k_32k", "32k_64k", "ge64k"]


def naive_bucket(n: float) -> int:
    if n < 4096:
        return 0
    if n < 16384:
        return 1
    if n < 32768:
        return 2
    return 3 if n < 65536 else 4


def test_buckets_have_the_documented_edges_and_labels():
    assert list(context.BUCKET_LABELS) == LABELS
    for n in (0, 1, 4095, 4096, 4097, 16383, 16384, 32767, 32768, 65535, 65536, 10**6):
        assert context.context_bucket(n) == naive_bucket(n), n


def _random_steps(rng, k_max):
    drafted = rng.randint(1, k_max)
    return rng.randint(0, drafted), drafted


def test_detailed_requests_are_counted_per_step_context_like_a_naive_count():
    rng = random.Random(0)
    k_max, buckets = 4, {}
    naive = {}  # bucket -> [steps, accepted, drafted tokens, accepted per pos, drafted per pos]
    for _ in range(60):
        prompt = rng.choice([10, 4000, 4090, 16000, 30000, 40000, 70000])
        steps = [_random_steps(rng, k_max) for _ in range(rng.randint(1, 80))]
        spec = {"acceptance_histogram": [0] * (k_max + 1), "per_step_accepted": [a for a, _ in steps],
                "per_step_drafted": [d for _, d in steps]}  # fmt: skip
        context.add_request(buckets, spec, prompt, 0)
        ctx = prompt + 1
        for a, d in steps:
            row = naive.setdefault(naive_bucket(ctx), [0, 0, 0, [0] * k_max, [0] * k_max])
            row[0] += 1
            row[1] += a
            row[2] += d
            for i in range(k_max):
                row[3][i] += i < a
                row[4][i] += i < d
            ctx += a + 1
    assert set(buckets) == set(naive)
    stats = context.bucket_stats(buckets)
    for b, (steps, acc, drafted, acc_pos, drafted_pos) in naive.items():
        label = LABELS[b]
        assert stats[f"rollout/spec_ctx_{label}_drafts"] == steps
        assert stats[f"rollout/spec_ctx_{label}_accept_rate"] == pytest.approx(acc / drafted)
        assert stats[f"rollout/spec_ctx_{label}_mean_accepted_len"] == pytest.approx(1 + acc / steps)
        u = [a / d for a, d in zip(acc_pos, drafted_pos, strict=True) if d]
        assert context.accept_by_bucket(stats)[label] == pytest.approx(u)


def test_summary_requests_go_to_the_bucket_of_their_midpoint_context():
    rng = random.Random(1)
    tracker, naive = context.ContextAcceptance(), {}
    for _ in range(40):
        prompt, out, k = rng.randint(0, 70000), rng.randint(1, 9000), 3
        accepted = [rng.randint(0, k) for _ in range(rng.randint(1, 50))]
        hist = [accepted.count(j) for j in range(k + 1)]
        tracker.add({"acceptance_histogram": hist, "num_draft_tokens": k * len(accepted)}, prompt, out)
        row = naive.setdefault(naive_bucket(prompt + out / 2), [0, [0] * k])
        row[0] += len(accepted)
        for i in range(k):
            row[1][i] += sum(a > i for a in accepted)
    tracker.add(None, 5, 5)  # a sample without statistics (vLLM 0.23) adds nothing
    got = context.accept_by_bucket(tracker.step())
    assert got == {LABELS[b]: pytest.approx([c / steps for c in pos]) for b, (steps, pos) in naive.items()}
    assert tracker.step() == {}  # the step's counts were handed out once


def brute_force_k(u, r, k_min, k_max, min_gain):
    value = {k: (1 + sum(u[:k])) / (1 + r * k) for k in range(k_min, k_max + 1)}
    best = min(k for k in value if value[k] == max(value.values()))
    return best if value[best] >= 1 + min_gain else 0


def test_choose_k_is_the_argmax_of_the_cost_model():
    rng = random.Random(2)
    for _ in range(300):
        k_max, k_min = rng.randint(1, 6), 1
        u, prev = [], 1.0
        for _ in range(k_max):
            prev *= rng.uniform(0.0, 1.0)
            u.append(prev)
        r, gain = rng.uniform(0.0, 0.6), rng.choice([0.0, 0.03, 0.1])
        assert choose_k(u, r, k_min, k_max, gain) == brute_force_k(u, r, k_min, k_max, gain), (u, r, gain)


def test_choose_k_goes_one_past_the_measured_depth_only():
    # u = [0.9]: iid 0.9 extrapolated pays up to k = 4 at r = 0.05, but only k = 2 is allowed next
    assert choose_k([0.9], 0.05, 1, 4, 0.0) == 2
    assert brute_force_k([0.9, 0.81, 0.729, 0.6561], 0.05, 1, 4, 0.0) == 4


def _stats(profiles: dict[str, list[float]], drafts=1000.0):
    out = {}
    for label, u in profiles.items():
        out[f"rollout/spec_ctx_{label}_drafts"] = drafts
        out.update({f"rollout/spec_ctx_{label}_accept_rate_pos{i}": v for i, v in enumerate(u)})
    return out


def test_controller_sets_k_per_bucket_and_reprobes_a_bucket_turned_off():
    cfg = SpecAdaptConfig(k_max=3, k_init=2, by_context=True, draft_cost=0.2, reprobe_every=3,
                          min_gain=0.03).validate()  # fmt: skip
    policy = ContextAwareK(cfg)
    good, bad = [0.95, 0.9], [0.1, 0.01]
    table = policy.observe(_stats({"lt4k": good, "32k_64k": bad}))
    assert table[0] == brute_force_k(good + [0.9 * 0.9 / 0.95], 0.2, 1, 3, 0.03) == 3
    assert table[3] == 0 and brute_force_k(bad, 0.2, 1, 2, 0.03) == 0
    assert table[1] == table[2] == table[4] == 2  # nothing measured there: k_init
    for _ in range(2):
        table = policy.observe(_stats({"lt4k": good + [0.85]}))
        assert table[3] == 0
    assert policy.observe(_stats({"lt4k": good + [0.85]}))[3] == 2  # reprobe_every steps off: probe again


def test_engine_takes_the_dominant_buckets_k():
    table = [3, 2, 1, 0, 0]
    assert k_driver.batch_k([], table, 2) == 2
    assert k_driver.batch_k([100, 5000, 6000], table, 2) == 2
    assert k_driver.batch_k([100, 40000], table, 2) == 0  # a tie takes the smaller k
    assert k_driver.batch_k([100, 200, 40000], table, 2) == 3


def test_spec_k_route_body_and_control_file_carry_the_table(tmp_path):
    fields = request_body.spec_k_fields(3)
    assert request_body.validate({"k": 2}, fields) == {"k": 2, "by_context": None}
    assert request_body.validate({"k": 2, "by_context": [3, 2, 0, 0, 0]}, fields)["by_context"] == [
        3,
        2,
        0,
        0,
        0,
    ]
    with pytest.raises(request_body.BodyError, match="by_context"):
        request_body.validate({"k": 2, "by_context": [4]}, fields)
    k_driver.write_k(tmp_path / "k", 2, [3, 2, 0, 0, 0])
    assert k_driver.read_line(tmp_path / "k") == (2, [3, 2, 0, 0, 0]) and k_driver.read_k(tmp_path / "k") == 2


def test_driver_by_context_sends_the_table_when_it_changes():
    calls = []

    class Client:
        async def set_spec_k(self, k, by_context=None):
            calls.append((k, by_context))

    cfg = SpecAdaptConfig(k_max=3, k_init=2, by_context=True, draft_cost=0.2).validate()
    driver = AdaptiveSpecDriver(Client(), cfg, log=lambda _: None)

    async def run():
        await driver.start()
        stats = _stats({"32k_64k": [0.1, 0.01]}) | {
            "rollout/spec_drafts": 10.0,
            "rollout/spec_draft_tokens": 20.0,
        }
        return await driver.step(1, stats)

    out = asyncio.run(run())
    assert calls == [(2, [2] * 5), (2, [2, 2, 2, 0, 2])]
    assert out["rollout/spec_k"] == 2.0 and out["rollout/spec_ctx_32k_64k_k"] == 0.0


def test_draft_cost_is_refused_without_by_context():
    from areal_npu.config import ConfigError
    from areal_npu.speculation.config import resolve_adapt

    with pytest.raises(ConfigError) as err:
        resolve_adapt({"draft_cost": 0.3}, k_max=4)
    assert err.value.key == "adapt.draft_cost"
    assert resolve_adapt({"by_context": True, "draft_cost": 0.3}, k_max=4).draft_cost == 0.3
    with pytest.raises(ConfigError, match="must be ≥ 0"):
        resolve_adapt({"by_context": True, "draft_cost": -1.0}, k_max=4)


def test_a_run_pools_buckets_over_steps_weighted_by_drafts_and_the_report_draws_them(tmp_path):
    from areal_npu.report.plots import plot_spec_context

    rows = [
        {"step": 1} | _stats({"lt4k": [0.9, 0.8], "32k_64k": [0.4]}, drafts=100.0),
        {"step": 2} | _stats({"lt4k": [0.6, 0.2]}, drafts=300.0),
    ]
    got = context.pooled_by_bucket(rows)
    assert list(got) == ["lt4k", "32k_64k"]  # bucket order, buckets with data only
    assert got["lt4k"]["accept_rate_pos0"] == pytest.approx((0.9 * 100 + 0.6 * 300) / 400)
    assert got["lt4k"]["accept_rate_pos1"] == pytest.approx((0.8 * 100 + 0.2 * 300) / 400)
    assert got["32k_64k"] == {"accept_rate_pos0": pytest.approx(0.4), "drafts": 100.0}
    assert got["lt4k"]["drafts"] == 400.0
    assert context.token_mix({"a": {"drafts": 100.0, "mean_accepted_len": 3.0}, "b": {"drafts": 100.0}}) == {
        "a": 0.75, "b": 0.25}  # fmt: skip
    path = plot_spec_context(rows, tmp_path / "spec_context.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_spec_context([{"step": 1}], tmp_path / "none.png") is None


def test_the_estimate_weights_each_buckets_acceptance_by_its_token_share():
    from areal_npu.speculation.cost import context_sweep, mixed_accepted_length, relative_cost_model

    # all drafts accepted at <4K (E[L_2] = 3), none at 32-64K (E[L_2] = 1); half the tokens each:
    # 1/3 of the verify steps make half the tokens, the other half take 1 token per step -> 1.5
    by_ctx, mix = {"lt4k": [1.0], "32k_64k": [0.0]}, {"lt4k": 1.0, "32k_64k": 1.0}
    assert mixed_accepted_length(by_ctx, mix, 2) == pytest.approx(1.5)
    r = 0.2
    swept = context_sweep(10.0, 20.0, by_ctx, mix, relative_cost_model(r), ks=range(5))
    chosen, row = swept.k_by_bucket, swept.aware
    assert chosen == {"lt4k": 4, "32k_64k": 0}  # brute force: (k+1)/(1+0.2k) rises with k; k=0 off
    # generation time over autoregressive: 0.5 * (1 + 0.2*4)/5 + 0.5 * 1/1
    assert row.gen_speedup == pytest.approx(1 / (0.5 * 1.8 / 5 + 0.5))
    with pytest.raises(ValueError, match="accept_by_context"):
        mixed_accepted_length(by_ctx, {"4k_16k": 1.0}, 1)


def test_plan_takes_acceptance_by_context_and_the_mix_from_the_command_line():
    import argparse

    from areal_npu.speculation import step_plan

    parser = argparse.ArgumentParser()
    step_plan.add_step_arguments(parser)
    args = parser.parse_args(["--t-gen", "50", "--t-step", "100", "--draft-cost", "0.2", "--max-k", "4",
                              "--accept-by-context", "lt4k=1.0;32k_64k=0.0", "--context-mix", "lt4k=1;32k_64k=1"])  # fmt: skip
    plan = step_plan.plan_from_numbers(args)
    assert [row["accepted_len"] for row in plan.sweep] == pytest.approx(
        [1 / (0.5 / (k + 1) + 0.5) for k in range(5)]
    )
    assert plan.context_k == {"lt4k": 4, "32k_64k": 0}
    with pytest.raises(ValueError, match="unknown context bucket"):
        step_plan.plan_from_numbers(parser.parse_args(["--t-gen", "1", "--accept-by-context", "8k=0.5"]))


def test_scheduler_applies_the_running_batchs_bucket_k_each_step(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from tests.speculation.test_k_driver import HookedScheduler

    path = tmp_path / "k"
    k_driver.write_k(path, 2, [3, 1, 0, 0, 0])
    monkeypatch.setenv(k_driver.ENV_FILE, str(path))
    sched = HookedScheduler(num_spec_tokens=3, max_num_seqs=4)
    assert sched.schedule().table == [2] * 5  # nothing running or waiting: k
    sched.waiting = [SimpleNamespace(num_tokens=50000)]
    assert sched.schedule().table == [0] * 5  # nothing running: the waiting requests' bucket
    sched.running = [SimpleNamespace(num_tokens=n) for n in (100, 200, 40000)]
    assert sched.schedule().table == [3] * 5 and sched.areal_last_k == 3  # mostly < 4K
    sched.running[0].num_tokens = sched.running[1].num_tokens = 20000
    assert sched.schedule().table == [0] * 5 and sched.areal_spec_k == 0  # mostly 16-32K: off
    k_driver.write_k(path, 1)  # back to one k for every batch
    assert sched.schedule().table == [1] * 5


def test_hill_climbing_settings_are_refused_with_by_context():
    from areal_npu.speculation.policy import HILL_CLIMBING_ONLY

    for name in HILL_CLIMBING_ONLY:
        value = getattr(SpecAdaptConfig, name)
        changed = value + 1 if isinstance(value, int) else value / 2
        SpecAdaptConfig(**{name: changed}).validate()  # read by today's policy
        with pytest.raises(ValueError, match=f"^{name}: is not read with by_context"):
            SpecAdaptConfig(by_context=True, **{name: changed}).validate()
