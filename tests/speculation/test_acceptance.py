"""Acceptance metrics are deltas of monotone engine counters; formulas checked by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_npu.speculation.acceptance import (
    SpecCounters,
    SpecMetricsTracker,
    counter_delta,
    request_spec_summary,
    spec_stats,
)


def snap(drafts, draft_tokens, accepted, gen, per_pos, t):
    return SpecCounters(drafts, draft_tokens, accepted, gen, 0.0, per_pos, t)


def test_step_deltas_by_hand():
    tracker = SpecMetricsTracker(snap(10, 30, 12, 100, [6, 4, 2], t=100.0))
    stats = tracker.step(snap(30, 90, 42, 400, [18, 14, 10], t=110.0))
    # step: 20 verify steps, 60 draft tokens, 30 accepted, 300 tokens in 10 s
    assert stats["rollout/spec_drafts"] == 20
    assert stats["rollout/spec_draft_tokens"] == 60
    assert stats["rollout/spec_accept_rate"] == pytest.approx(30 / 60)
    assert stats["rollout/spec_mean_accepted_len"] == pytest.approx(1 + 30 / 20)
    assert [stats[f"rollout/spec_accept_rate_pos{i}"] for i in range(3)] == pytest.approx(
        [12 / 20, 10 / 20, 8 / 20]
    )
    assert stats["rollout/tokens_per_s"] == pytest.approx(30.0)
    # next step measures from the last snapshot
    stats = tracker.step(snap(30, 90, 42, 400, [18, 14, 10], t=111.0))
    assert stats["rollout/spec_drafts"] == 0 and stats["rollout/spec_mean_accepted_len"] == 1.0
    assert stats["rollout/spec_accept_rate"] == 0.0 and stats["rollout/tokens_per_s"] == 0.0


def test_engine_restart_does_not_go_negative():
    prev = snap(100, 300, 150, 1000, [60, 50, 40], t=10.0)
    cur = snap(5, 15, 6, 40, [3, 2, 1], t=20.0)  # counters restarted from zero
    delta = counter_delta(prev, cur)
    assert (delta.drafts, delta.accepted, delta.generation_tokens) == (5, 6, 40)
    assert delta.accepted_per_pos == [3, 2, 1]


def test_from_vllm_metrics_sums_label_sets_and_engines():
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=4),
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=6),  # a second label set
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=20),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=9),
        SimpleNamespace(name="vllm:generation_tokens", value=50),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 4]),
        SimpleNamespace(name="vllm:num_requests_running", value=3),
    ]
    c = SpecCounters.from_vllm_metrics(metrics, now=1.0)
    assert (c.drafts, c.draft_tokens, c.accepted, c.generation_tokens) == (10, 20, 9, 50)
    both = c + SpecCounters.from_dict(c.to_dict())
    assert both.drafts == 20 and both.accepted_per_pos == [10, 8]
    stats = spec_stats(both)
    assert stats["rollout/spec_accept_rate"] == pytest.approx(18 / 40)


def test_request_summaries_pool():
    pooled = request_spec_summary(
        [
            {"num_spec_steps": 4, "num_draft_tokens": 8, "num_accepted_draft_tokens": 6},
            {"num_spec_steps": 6, "num_draft_tokens": 12, "num_accepted_draft_tokens": 4},
        ]
    )
    assert pooled["spec_accept_rate"] == pytest.approx(10 / 20)
    assert pooled["spec_mean_accepted_len"] == pytest.approx(1 + 10 / 10)
