"""StatsLogger: metrics.jsonl (durable, resumable), TensorBoard scalars, the per-step status line.

References are independent of the code: the stats dicts the test logs, the file read back with the
json module, TensorBoard events read back with tensorboard's own EventAccumulator, and status lines
written out by hand.
"""

import io
import json
import time

import pytest

from areal_npu.metrics import MetricsError, StatsLogger, read_metrics


def _stats(step: int, tag: float = 0.0) -> dict:
    return {
        "reward/mean": 0.1 * step + tag,
        "loss/policy": -0.01 * step,
        "rollout/spec_k": 2,
        "rollout/spec_accept_per_pos": [0.8, 0.5],
    }


def _lines(run_dir):
    return [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_round_trip(tmp_path):
    before = time.time()
    with StatsLogger(tmp_path, total_steps=3, console=False, tensorboard=False) as log:
        for step in (1, 2, 3):
            log.log(step, _stats(step))
    after = time.time()
    lines = _lines(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert before <= line["time"] <= after
        expected = {"step": line["step"], "time": line["time"], **_stats(line["step"])}
        assert line == expected
        assert list(line)[:2] == ["step", "time"]
    assert read_metrics(tmp_path) == lines


def test_non_finite_values_are_json_null(tmp_path):
    with StatsLogger(tmp_path, total_steps=1, console=False, tensorboard=False) as log:
        log.log(1, {"a": float("nan"), "b": float("inf"), "c": 1.5})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    line = json.loads(text)
    assert line["a"] is None and line["b"] is None and line["c"] == 1.5


def test_resume_truncates_without_duplicated_steps(tmp_path):
    with StatsLogger(tmp_path, total_steps=6, console=False, tensorboard=False) as log:
        for step in range(1, 6):
            log.log(step, _stats(step))
    # kill -9 in the middle of writing step 6: a torn line without its newline
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "time": 1.0, "reward/me')

    # the run resumes from its checkpoint at step 3
    with StatsLogger(tmp_path, total_steps=6, console=False, tensorboard=False) as log:
        assert log.last_step == 5
        with pytest.raises(ValueError, match="truncate_after"):
            log.log(4, _stats(4))
        log.truncate_after(3)
        assert log.last_step == 3
        for step in (4, 5, 6):
            log.log(step, _stats(step, tag=100.0))

    lines = _lines(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    for line in lines:
        tag = 100.0 if line["step"] > 3 else 0.0
        assert line["reward/mean"] == pytest.approx(0.1 * line["step"] + tag)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp files left


def test_torn_last_line_is_cut_before_appending(tmp_path):
    with StatsLogger(tmp_path, total_steps=3, console=False, tensorboard=False) as log:
        log.log(1, _stats(1))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "ti')
    with StatsLogger(tmp_path, total_steps=3, console=False, tensorboard=False) as log:
        assert log.last_step == 1
        log.log(2, _stats(2))
    assert [line["step"] for line in _lines(tmp_path)] == [1, 2]


def test_reserved_keys_are_refused(tmp_path):
    with StatsLogger(tmp_path, total_steps=1, console=False, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 3})


def test_read_metrics_errors(tmp_path):
    with pytest.raises(MetricsError, match="no metrics.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(MetricsError, match="no steps"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsError, match=":2:"):
        read_metrics(tmp_path)


def _scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_read_back(tmp_path):
    with StatsLogger(tmp_path, total_steps=3, console=False) as log:
        for step in (1, 2, 3):
            log.log(step, _stats(step))
    for tag, fn in [
        ("reward/mean", lambda s: 0.1 * s),
        ("loss/policy", lambda s: -0.01 * s),
        ("rollout/spec_k", lambda s: 2),
    ]:
        got = _scalars(tmp_path / "tb", tag)
        assert [s for s, _ in got] == [1, 2, 3]
        assert [v for _, v in got] == pytest.approx([fn(s) for s in (1, 2, 3)], rel=1e-6)


def test_tensorboard_after_resume_has_no_stale_steps(tmp_path):
    with StatsLogger(tmp_path, total_steps=5, console=False) as log:
        for step in range(1, 6):
            log.log(step, _stats(step))
    with StatsLogger(tmp_path, total_steps=5, console=False) as log:
        log.truncate_after(3)
        for step in (4, 5):
            log.log(step, _stats(step, tag=100.0))
    got = dict(_scalars(tmp_path / "tb", "reward/mean"))
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, value in got.items():
        assert value == pytest.approx(0.1 * step + (100.0 if step > 3 else 0.0), rel=1e-6)


FULL = {
    "reward/mean": 0.41,
    "rollout/spec_accept_rate": 0.63,
    "rollout/spec_mean_accepted_len": 2.1,
    "staleness/max": 1,
    "ppo/behave_imp_weight/mean": 0.999,
    "timing/step_s": 8.3,
    "timing/gen_s": 5.1,
    "timing/train_s": 2.0,
    "timing/sync_s": 0.4,
}


def test_headless_status_line(tmp_path):
    out = io.StringIO()  # not a terminal: one plain line per step
    with StatsLogger(tmp_path, total_steps=40, console=True, tensorboard=False, stream=out) as log:
        log.log(1, {"reward/mean": 0.19})
        log.log(12, FULL)
        log.log(13, {"loss/policy": 0.5, "timing/gen_s": 1.3})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0] == "step 1/40 | reward 0.19 (+0.00)"
    assert lines[1] == (
        "step 12/40 | reward 0.41 (+0.22) | accept 0.63 len 2.1 | stale max 1 | imp_w 0.999 "
        "| step 8.3s (gen 5.1 train 2.0 sync 0.4)"
    )
    # absent keys are left out
    assert lines[2].startswith("step 13/40") and "reward" not in lines[2] and "gen 1.3" in lines[2]


def test_status_line_shows_every_step_phase_a_run_logs_and_no_side_phase():
    from areal_npu.metrics import format_status

    stats = FULL | {"timing/prox_s": 0.6, "timing/reward_s": 7.0}  # reward overlaps gen: not a step phase
    assert format_status(12, 40, stats).endswith("| step 8.3s (gen 5.1 prox 0.6 train 2.0 sync 0.4)")


def test_messages_go_to_the_status_stream_not_the_metrics(tmp_path):
    out = io.StringIO()
    with StatsLogger(tmp_path, total_steps=4, console=True, tensorboard=False, stream=out) as log:
        log.log(0, {"reward/mean": 0.1})
        log.print("[spec] step 0: k 2 -> 0: reason")
    assert out.getvalue().splitlines()[-1] == "[spec] step 0: k 2 -> 0: reason"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0]


def test_reward_change_is_against_the_run_start_after_resume(tmp_path):
    with StatsLogger(tmp_path, total_steps=4, console=False, tensorboard=False) as log:
        log.log(1, {"reward/mean": 0.25})
        log.log(2, {"reward/mean": 0.30})
    out = io.StringIO()
    with StatsLogger(tmp_path, total_steps=4, console=True, tensorboard=False, stream=out) as log:
        log.log(3, {"reward/mean": 0.75})
    assert out.getvalue().strip() == "step 3/4 | reward 0.75 (+0.50)"


def test_console_false_prints_nothing(tmp_path, capsys):
    with StatsLogger(tmp_path, total_steps=2, console=False, tensorboard=False) as log:
        line = log.log(1, FULL)
    assert capsys.readouterr().out == ""
    assert "imp_w 0.999" in line


def test_terminal_gets_a_progress_bar(tmp_path, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats the stream as a terminal
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    out = io.StringIO()
    with StatsLogger(tmp_path, total_steps=40, console=True, tensorboard=False, stream=out) as log:
        log.log(12, FULL)
        assert log._progress is not None
    text = out.getvalue()
    assert "imp_w" in text and "0.999" in text and "12/40" in text
