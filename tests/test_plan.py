"""`areal-npu plan` end to end, as a user runs it: command-line numbers and a synthetic run directory."""

import json
import shutil
import subprocess
import sys

import pytest

from areal_npu.speculation.cost import CostModel
from areal_npu.speculation.planner import expected_accepted_length, unconditional_from_conditional


def _plan(*args):
    exe = shutil.which("areal-npu")
    argv = [exe] if exe else [sys.executable, "-m", "areal_npu.cli"]
    return subprocess.run(argv + ["plan", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_published_numbers_table_and_png(tmp_path):
    png = tmp_path / "plan.png"
    out = _plan(
        "--t-data", 0.2, "--t-prepare", 1.9, "--t-gen", 100, "--t-logprob", 17.8, "--t-train", 31.3,
        "--t-gen-spec", 56.6, "--k", 3, "--accept", 0.6, "--plot", png,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "recommended k = 3" in out.stdout and "1.403" in out.stdout
    for k in range(9):
        assert f"│ {k} │" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "gen,gen_spec,step,step_spec", [(100.0, 56.6, 151.2, 107.5), (133.6, 87.0, 185.3, 137.4)]
)
def test_published_numbers_json_within_2_percent(gen, gen_spec, step, step_spec):
    out = _plan("--t-gen", gen, "--t-step", step, "--t-gen-spec", gen_spec, "--k", 3, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["bound_at_measured"] == pytest.approx(step / step_spec, rel=0.02)
    assert plan["recommended_k"] == 3


def test_missing_k_is_an_input_error():
    out = _plan("--t-gen", 100, "--t-step", 150, "--gen-speedup", 1.7)
    assert (
        out.returncode == 2 and out.stderr.startswith("areal-npu plan: --k") and "Traceback" not in out.stderr
    )


@pytest.mark.parametrize("keys", ["planner", "spec_stats"])
def test_run_dir(tmp_path, keys):
    """An adaptive run: mostly k = 3, a few k = 0 and k = 2 probes; engine timings from a known cost model."""
    truth = CostModel(v0=0.030, v1=0.0005, d0=0.004, d1=0.0001)
    cond, batch, tokens = [0.85, 0.7, 0.5], 64, 200_000  # tokens generated per step
    lines = []
    for step, k in enumerate([3] * 10 + [0] * 3 + [2] * 3 + [3] * 6):
        length = expected_accepted_length(cond, k) if k else 1.0
        tps = truth.tokens_per_s(batch, k, length)
        line = {
            "step": step, "timing/data_s": 0.5, "timing/prepare_s": 2.0, "timing/gen_s": tokens / tps,
            "timing/prox_s": 15.0, "timing/train_s": 30.0,
            "rollout/batch_size": batch, "rollout/tokens_per_s": tps,
        }  # fmt: skip
        line["timing/step_s"] = sum(v for key, v in line.items() if key.startswith("timing/"))
        per_pos = unconditional_from_conditional(cond[:k])
        if keys == "planner":  # the keys areal_npu.speculation.planner documents
            line["rollout/spec_k"] = k
            if k:
                line["rollout/spec_accept_per_pos"] = per_pos
                line["rollout/spec_accept_rate"] = sum(per_pos) / k
        else:  # the keys areal_npu.speculation.acceptance.spec_stats writes (counter deltas, 100 drafts)
            line |= {"rollout/spec_drafts": 100.0 * bool(k), "rollout/spec_draft_tokens": 100.0 * k}
            line |= {f"rollout/spec_accept_rate_pos{i}": u for i, u in enumerate(per_pos)}
        lines.append(line)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")

    out = _plan(tmp_path, "--json", "--plot", tmp_path / "p.png")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    t_gen_ar = tokens / truth.tokens_per_s(batch, 0, 1.0)
    assert plan["t_gen_ar"] == pytest.approx(t_gen_ar, rel=0.01)
    assert plan["t_step_ar"] == pytest.approx(t_gen_ar + 47.5, rel=0.01)
    # One batch size: only t(64, k) is identifiable, not the batch split of each coefficient.
    fit = CostModel(**plan["cost"])
    for k in range(6):
        assert fit.step_time(batch, k) == pytest.approx(truth.step_time(batch, k), rel=0.01)
    true_best = max(range(9), key=lambda k: truth.gen_speedup(batch, k, expected_accepted_length(cond, k)))
    assert plan["recommended_k"] == true_best
    assert (tmp_path / "p.png").stat().st_size > 1000

    if keys == "spec_stats":
        return
    table = _plan(tmp_path)
    assert table.returncode == 0 and "recommended k" in table.stdout and "gen" in table.stdout


def test_run_dir_as_a_real_run_logs_it(tmp_path):
    """The phases the controller logs (prox included, reward shown but not added to the step), read
    like every metrics reader: a step logged twice counts once (its last line), a torn last line is
    dropped."""
    rows = []
    for step in range(2):
        rows.append({"step": step, "time": float(step), "timing/gen_s": 6.0, "timing/prox_s": 1.0,
                     "timing/train_s": 2.0, "timing/sync_s": 1.0, "timing/reward_s": 9.0,
                     "timing/step_s": 10.0, "rollout/spec_k": 0})  # fmt: skip
    # both steps first logged by a run that was resumed before them (no truncation): superseded
    stale = [dict(r, **{"timing/gen_s": 600.0, "timing/step_s": 604.0}) for r in rows]
    lines = [json.dumps(r) for r in (*stale, *rows)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "timing/ge')

    out = _plan(tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["phases"] == {
        "gen": 6.0, "prox": 1.0, "train": 2.0, "sync": 1.0, "reward": 9.0, "step": 10.0,
    }  # fmt: skip
    assert plan["t_gen_ar"] == 6.0 and plan["t_step_ar"] == 10.0 and plan["gen_fraction"] == 0.6
    table = _plan(tmp_path)
    assert table.returncode == 0 and "prox" in table.stdout and "reward (not in step)" in table.stdout


def test_command_line_phases_are_the_runs_phases():
    """``--t-prox`` (``--t-logprob``, NeMo-RL's name, is the same phase) adds to the step like the others."""
    for flag in ("--t-prox", "--t-logprob"):
        out = _plan("--t-gen", 60, flag, 10, "--t-train", 30, "--json")
        assert out.returncode == 0, out.stderr
        plan = json.loads(out.stdout)
        assert plan["phases"] == {"gen": 60.0, "prox": 10.0, "train": 30.0} and plan["t_step_ar"] == 100.0


def _quickstart_like(run_dir, config: str | None):
    """What recipes/cpu/quickstart.yaml's run writes: one draft length (k = 2), acceptance per
    position, no ``rollout/batch_size``, so the throughput alone cannot calibrate a cost model."""
    run_dir.mkdir()
    rows = [{"step": s, "time": float(s), "timing/gen_s": 3.0, "timing/prox_s": 0.1, "timing/train_s": 0.3,
             "timing/sync_s": 0.1, "timing/reward_s": 5.0, "timing/step_s": 3.5, "rollout/spec_k": 2.0,
             "rollout/spec_drafts": 100.0, "rollout/spec_draft_tokens": 200.0, "rollout/tokens_per_s": 40.0,
             "rollout/spec_accept_rate_pos0": 0.4, "rollout/spec_accept_rate_pos1": 0.2}
            for s in range(3)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (run_dir / "config.yaml").write_text(config)
    return run_dir


@pytest.mark.parametrize(
    "config,r,why",
    [
        (
            "model:\n  tiny:\n    num_hidden_layers: 4\n    mtp_num_hidden_layers: 1\n",
            0.25,
            "1 MTP / 4 model",
        ),
        (None, 0.0, "drafts taken as free"),
    ],
)
def test_quickstart_run_dir_falls_back_to_the_models_draft_cost(tmp_path, config, r, why):
    run_dir = _quickstart_like(tmp_path / "run", config)
    out = _plan(run_dir, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    a = (1 + 0.4 + 0.2) / (1 + r * 2)  # accepted length over the cost of one k = 2 verify step
    assert plan["measured_k"] == 2 and plan["measured_gen_speedup"] == pytest.approx(a)
    assert plan["t_gen_ar"] == pytest.approx(3.0 * a)
    assert any(why in note and "--draft-cost" in note for note in plan["notes"])
    given = json.loads(_plan(run_dir, "--json", "--draft-cost", 0.5).stdout)  # the flag wins
    assert given["measured_gen_speedup"] == pytest.approx(1.6 / 2.0)
