"""The trainer-side adaptive-speculation driver: step metrics in, engines' draft length out (no engine)."""

from __future__ import annotations

import asyncio
import json

from areal_npu.speculation.adaptive import AdaptiveSpecDriver, accept_per_pos
from areal_npu.speculation.policy import SpecAdaptConfig


class RecordingClient:
    def __init__(self):
        self.k_calls: list[int] = []

    async def set_spec_k(self, k: int) -> None:
        self.k_calls.append(k)


def test_accept_per_pos_reads_the_step_metrics():
    stats = {"rollout/spec_accept_rate_pos0": 0.8, "rollout/spec_accept_rate_pos1": 0.5}
    assert accept_per_pos(stats, 3) == [0.8, 0.5, 0.0]


def test_driver_applies_and_logs_each_decision(tmp_path):
    """Rejected drafts (acceptance 0.01 < off_accept) for `accept_window` steps: the driver sets k=0 on the
    engines once, logs why, and reports the k each step ran with."""
    client, lines = RecordingClient(), []
    cfg = SpecAdaptConfig(k_max=3, k_init=2, accept_window=2)
    driver = AdaptiveSpecDriver(client, cfg, log=lines.append, decisions_path=tmp_path / "d.jsonl")

    async def run():
        await driver.start()
        bad = {"rollout/spec_accept_rate_pos0": 0.01, "rollout/spec_accept_rate_pos1": 0.0,
               "rollout/tokens_per_busy_s": 100.0}  # fmt: skip
        return [await driver.step(s, bad) for s in range(3)]

    out = asyncio.run(run())
    assert client.k_calls == [2, 0]
    assert [o["rollout/spec_k"] for o in out] == [2.0, 2.0, 0.0]
    assert [o["rollout/spec_k_next"] for o in out] == [2.0, 0.0, 0.0]
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [(r["step"], r["k_from"], r["k_to"]) for r in rows] == [(1, 2, 0)]
    assert "acceptance" in rows[0]["reason"] and len(lines) == 1 and "k 2 -> 0" in lines[0]
