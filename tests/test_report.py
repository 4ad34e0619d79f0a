"""`areal-npu report` on synthetic run directories.

The metrics file is written here with the json module (not with StatsLogger), the reward summary is
checked against means computed here, and the PNGs are checked by their signature and IHDR header.
"""

import json
import math
import random
import struct

import pytest

from areal_npu.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = {
    "reward",
    "training",
    "spec_accept",
    "mtp",
    "imp_weight",
    "version_lag",
    "episodes",
    "step_time",
    "perf",
}
OPTIONAL = {"episodes", "episode_rate", "env_latency"}  # drawn only for runs that log their keys


def _write_run(run_dir, rows, config=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    if config is not None:
        (run_dir / "config.yaml").write_text(config)


def _full_rows(n=23, seed=0):
    rng = random.Random(seed)
    rows = []
    for step in range(1, n + 1):
        mean = 0.2 + 0.02 * step + rng.uniform(-0.05, 0.05)
        rows.append(
            {
                "step": step,
                "time": 1_700_000_000.0 + 10.0 * step,
                "reward/mean": mean,
                "reward/min": mean - 0.2,
                "reward/max": mean + 0.2,
                "rollout/spec_accept_rate": rng.uniform(0.5, 0.7),
                "rollout/spec_mean_accepted_len": rng.uniform(1.8, 2.4),
                "rollout/spec_accept_rate_pos0": 0.8,
                "rollout/spec_accept_rate_pos1": 0.5,
                "rollout/spec_k": 2,
                "mtp/loss_d1": 3.0 - 0.05 * step,
                "mtp/acc_d1": 0.3 + 0.01 * step,
                "ppo/behave_imp_weight/mean": rng.uniform(0.98, 1.02),
                "ppo/behave_imp_weight/min": 0.9,
                "ppo/behave_imp_weight/max": 1.1,
                "ppo/version_lag/mean": 0.5,
                "ppo/version_lag/max": 1,
                "staleness/max": 1,
                "timing/gen_s": 5.0,
                "timing/reward_s": 0.3,
                "timing/prox_s": 0.6,
                "timing/train_s": 2.0,
                "timing/sync_s": 0.4,
                "timing/step_s": 8.5,
                "perf/step_speedup_bound": 1.4,
                "perf/gen_fraction": 0.59,
                "episode/turns": rng.uniform(2, 4),
                "episode/tokens": 900.0 + step,
                "episode/model_tokens": 200.0,
                "episode/pass_rate": rng.uniform(0.5, 1.0),
                "episode/format_errors": 0.25,
                "episode/submitted": 0.75,
                "reward/solved": mean,
                "ppo/loss": 0.1 / step,
                "train/grad_norm": 1.0 + 0.01 * step,
                "ppo/entropy": 2.0 - 0.01 * step,
            }
        )
    return rows


def _sig3(x):
    """Three significant digits, as the report prints numbers from 0.001 to 100 (trailing zeros dropped)."""
    text = repr(round(x, 2 - math.floor(math.log10(abs(x)))))
    return text.removesuffix(".0")


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0


def test_full_report(tmp_path, capsys):
    rows = _full_rows()
    run_dir, out = tmp_path / "run", tmp_path / "out"
    _write_run(run_dir, rows, config="name: demo-run\nseed: 3\n")
    assert main(["report", str(run_dir), "--out", str(out)]) == 0

    printed = capsys.readouterr().out.split()
    assert {p.rsplit("/", 1)[-1] for p in printed} == {f"{p}.png" for p in ALL_PLOTS} | {"report.md"}
    assert {p.name for p in out.iterdir()} == {f"{p}.png" for p in ALL_PLOTS} | {"report.md"}
    for name in ALL_PLOTS:
        _assert_png(out / f"{name}.png")

    # independent reference: first and last ~20 % (ceil(n / 5) steps) of reward/mean
    rewards = [r["reward/mean"] for r in rows]
    k = math.ceil(len(rewards) / 5)
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    md = (out / "report.md").read_text()
    assert "demo-run" in md
    assert f"start {_sig3(start)}, end {_sig3(end)}, change +{_sig3(end - start)}" in md
    assert f"(step 23): {_sig3(rows[-1]['rollout/spec_accept_rate'])}" in md
    imp = [r["ppo/behave_imp_weight/mean"] for r in rows]
    assert f"behave_imp_weight: {_sig3(sum(imp) / len(imp))} over 23 steps" in md
    assert f"{8.5 * len(rows):.1f} s" in md  # total step time
    assert f"| `reward/mean` | {_sig3(rows[-1]['reward/mean'])} | mean reward of" in md
    for name in ALL_PLOTS:
        assert f"]({name}.png)" in md
    assert "Missing" not in md


def test_default_out_dir_and_duplicated_steps(tmp_path):
    rows = _full_rows(n=10)
    # a resume that did not truncate: step 9 and 10 logged twice, the later lines win
    rerun = [dict(r, **{"reward/mean": 5.0}) for r in rows[-2:]]
    _write_run(tmp_path, rows + rerun)
    assert main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Steps: 1–10 (10 logged)" in md
    assert "end 5," in md  # last ceil(10/5) = 2 steps, both re-logged at 5.0


def test_missing_keys_are_skipped(tmp_path, capsys):
    rows = [{"step": s, "time": 1.0 * s, "reward/mean": 0.1 * s, "timing/gen_s": 1.0} for s in range(1, 6)]
    _write_run(tmp_path, rows)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    written = {p.name for p in (tmp_path / "r").iterdir()}
    assert written == {"reward.png", "step_time.png", "report.md"}
    _assert_png(tmp_path / "r" / "reward.png")
    md = (tmp_path / "r" / "report.md").read_text()
    for name in ALL_PLOTS - {"reward", "step_time"} - OPTIONAL:
        assert name in md.split("## Missing from metrics.jsonl")[1]
    assert "`rollout/spec_accept_rate`" in md and "`ppo/behave_imp_weight/mean`" in md
    # rewards 0.1..0.5: first and last ceil(5/5) = 1 step
    assert "start 0.1, end 0.5, change +0.4" in md
    # a run from before the environment metrics: no environment plots, not even as missing
    assert "episode_rate" not in md and "env_latency" not in md and "env backend" not in md
    assert "episodes" not in md  # a single-turn run: no per-episode stats, not missing either


@pytest.mark.parametrize("content", [None, "", "\n\n"])
def test_missing_or_empty_metrics_exit_2(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "Traceback" not in err
    assert not (tmp_path / "report").exists()


def test_missing_run_dir_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_spec_decisions_are_listed(tmp_path):
    """The adaptive driver's decision log appears in the report (last 20, newest last); junk lines skipped."""
    _write_run(tmp_path, _full_rows(n=5))
    decisions = [
        {"step": s, "k_from": s % 3, "k_to": (s + 1) % 3, "reason": f"reason {s}"} for s in range(25)
    ]
    lines = [json.dumps(d) for d in decisions] + ["not json", json.dumps({"step": 99})]
    (tmp_path / "spec_decisions.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Draft-length decisions" in md and "last 20 of 25" in md
    assert "| 24 | 0 → 1 | reason 24 |" in md and "reason 4 |" not in md and "| 99 |" not in md


ENV_PLOTS = {"episode_rate", "env_latency"}


def _env_rows(backends):
    """Shell-agent steps on task environments: ``backends[i]`` ran step ``i + 1``'s 10 episodes."""
    return [
        {
            "step": step,
            "time": 100.0 * step,
            "reward/mean": 0.5,
            "episode/per_minute": 12.0 + step,
            "episode/env_start_s": 0.5 * step,
            "episode/env_start_s_p95": 1.5 * step,
            "episode/grade_s": 2.0 + step,
            "episode/grade_s_p95": 3.25 + step,
            f"env/backend_{backend}": 10,
        }
        for step, backend in enumerate(backends, start=1)
    ]


def test_environment_plots_table_and_backend(tmp_path):
    _write_run(tmp_path, _env_rows(["bwrap"] * 4))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    written = {p.name for p in (tmp_path / "r").iterdir()}
    assert written == {"reward.png", "episode_rate.png", "env_latency.png", "report.md"}
    for name in ENV_PLOTS:
        _assert_png(tmp_path / "r" / f"{name}.png")
    md = (tmp_path / "r" / "report.md").read_text()
    # 4 steps of 10 episodes on one backend; bwrap isolates, so nothing is flagged
    assert "- env backend: bwrap (40 episodes, steps 1–4)" in md
    # means over steps 1..4 of the fixture's values; the largest p95 is step 4's
    assert "- episodes per minute (mean over 4 steps): 14.5" in md
    assert "- `episode/env_start_s` (mean over 4 steps): 1.25 s, largest step p95 6 s" in md
    assert "- `episode/grade_s` (mean over 4 steps): 4.5 s, largest step p95 7.25 s" in md
    # the last step's table: step 4's values as written
    for row in [
        "| `episode/per_minute` | 16 |",
        "| `episode/env_start_s` | 2 |",
        "| `episode/env_start_s_p95` | 6 |",
        "| `episode/grade_s` | 6 |",
        "| `episode/grade_s_p95` | 7.25 |",
        "| `env/backend_bwrap` | 10 |",
    ]:
        assert row in md
    for name in ENV_PLOTS:
        assert f"]({name}.png)" in md


def test_mixed_and_weaker_backends_are_flagged(tmp_path):
    """A run that fell back to a weaker backend part-way shows every backend, its steps and episodes."""
    _write_run(tmp_path, _env_rows(["bwrap", "bwrap", "process", "process", "process", "quartz"]))
    assert main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("- env backends"))
    assert line == (
        "- env backends (**3 different**): bwrap (20 episodes, steps 1–2); "
        "process (30 episodes, steps 3–5, **no isolation**); quartz (10 episodes, steps 6–6, isolation unknown)"
    )
    assert "| `env/backend_quartz` | 10 |" in md and "env/backend_process` |" not in md  # last step only
