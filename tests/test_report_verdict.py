"""The report's verdict sentences and plot helpers, on hand-made metrics rows whose answers are
worked out by hand in the comments (noise formulas: areal_npu/report/verdict.py's docstring)."""

import json

from areal_npu.cli import main
from areal_npu.report import plots, verdict


def _rows(values, key="reward/mean", **extra):
    return [{"step": s, key: v, **extra} for s, v in enumerate(values)]


def test_learning_from_the_held_out_eval():
    config = {"controller": {"eval_size": 128}, "task": {"n_eval": 400}}  # 128 prompts per eval
    rows = [{"step": 0, "eval/reward": 0.41}, {"step": 10}, {"step": 20, "eval/reward": 0.63}]
    # noise 2·sqrt(0.41·0.59/128 + 0.63·0.37/128) = 2·sqrt(0.0018898 + 0.0018211) = 0.1218
    assert verdict.learning(rows, config) == (
        "Learned: held-out reward 0.41 → 0.63 (steps 0–20, 128 prompts, noise ±0.122)."
    )
    rows[-1]["eval/reward"] = 0.45  # +0.04, inside ±0.12
    assert verdict.learning(rows, config).startswith("Did not clearly learn: held-out reward 0.41 → 0.45")
    rows[0]["eval/reward"] = rows[-1]["eval/reward"] = 0.0  # the quickstart's: nothing solved, ever
    assert (
        verdict.learning(rows, config)
        == "Did not learn: held-out reward 0 at every one of 2 evals (steps 0–20)."
    )
    rows[-1]["eval/reward"] = 0.05  # 0 counts as 1/128: 2·sqrt(6.06e-5 + 3.71e-4) = 0.0416
    assert verdict.learning(rows, config) == (
        "Learned: held-out reward 0 → 0.05 (steps 0–20, 128 prompts, noise ±0.0416)."
    )


def test_learning_from_the_training_trend():
    # 0.0, 0.1, ..., 0.9: every Δ = 0.1, σ = sqrt(0.01 / 2) = 0.0707; k = 2, noise 2·σ·sqrt(2/2) = 0.141;
    # start (0 + 0.1) / 2 = 0.05, end (0.8 + 0.9) / 2 = 0.85
    rising = _rows([i / 10 for i in range(10)])
    assert verdict.learning(rising) == (
        "Learned: training reward 0.05 → 0.85 (first and last 2 of 10 steps; noise ±0.141)."
    )
    # 0.3, 0.5, 0.3, ...: every |Δ| = 0.2, σ = 0.1414, noise 0.283; start = end = 0.4
    flat = _rows([0.3, 0.5] * 5)
    assert verdict.learning(flat) == (
        "Did not clearly learn: training reward 0.4 → 0.4 (first and last 2 of 10 steps; noise ±0.283)."
    )
    assert verdict.learning(_rows([1.0 - i / 10 for i in range(10)])).startswith("Got worse")
    assert verdict.learning(_rows([0.0, 0.0, 0.0])).startswith(
        "Did not learn: the training reward was 0 at every one of 3 steps"
    )


def test_time_bound_by_the_largest_phase():
    t = {"timing/gen_s": 0.0002, "timing/prox_s": 0.5, "timing/train_s": 3.5, "timing/sync_s": 0.5}
    rows = [{"step": s, **t, "timing/step_s": 4.5, "timing/reward_s": 17.0} for s in range(3)]
    # 3.5 / 4.5 = 78 %; generation under a tenth of the step while the workflows took 17 s
    assert verdict.time_spent(rows) == (
        "The step (median 4.5 s) was bound by training: 78% of it; rollouts ran ahead of it (their "
        "generation and grading, 17 s summed over concurrent groups, overlapped training)."
    )
    rows[0]["timing/reward_s"] = rows[1]["timing/reward_s"] = 0.0  # median 0: nothing ran ahead
    assert verdict.time_spent(rows) == "The step (median 4.5 s) was bound by training: 78% of it."
    gen_bound = [{"step": 0, "timing/gen_s": 6.0, "timing/train_s": 2.0}]  # no step_s: their sum, 8
    assert verdict.time_spent(gen_bound) == (
        "The step (median 8 s) was bound by generation (waiting for the batch of rollouts): 75% of it."
    )


def test_speculation_sentences():
    base = {"rollout/spec_k": 2, "rollout/spec_mean_accepted_len": 1.02, "perf/step_speedup_bound": 1.0001}
    assert verdict.speculation([{"step": 0, **base}]) == (
        "Speculation did not speed this run up (1.02 tokens per verify step at k = 2; step speed-up bound ×1)."
    )
    paid = [{"step": 0, **base, "rollout/spec_mean_accepted_len": 2.0, "perf/step_speedup_bound": 1.4}]
    # generation at most 1 - 1/2 = 50 % shorter; the step at most 1 - 1/1.4 = 28.6 %
    assert verdict.speculation(paid) == (
        "Speculation saved at most 50% of generation time and 29% of the step "
        "(2 tokens per verify step at k = 2, drafts taken as free)."
    )
    assert verdict.speculation([{"step": 0, "rollout/spec_k": 0}]) == "Speculation was off."
    assert verdict.speculation([{"step": 0}]) is None


def test_checkpoint_named(tmp_path):
    assert verdict.checkpoint(tmp_path).startswith("No checkpoint under")
    for n in (4, 9, 12):
        (tmp_path / "checkpoints" / f"step_{n}").mkdir(parents=True)
    assert (
        verdict.checkpoint(tmp_path)
        == f"Checkpoint: {tmp_path}/checkpoints/step_12 (a Hugging Face model directory)."
    )
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")  # step_12 not finished: latest wins
    assert f"{tmp_path}/checkpoints/step_9 " in verdict.checkpoint(tmp_path)


def test_report_opens_with_the_verdict(tmp_path):
    rows = [
        {"step": s, "reward/mean": 0.0, "timing/gen_s": 0.001, "timing/train_s": 3.0, "timing/step_s": 3.2,
         "rollout/spec_k": 2, "rollout/spec_mean_accepted_len": 1.01, "perf/step_speedup_bound": 1.0001,
         "ppo/loss": 0.0, "train/grad_norm": 0.0, "ppo/entropy": 5.7}
        for s in range(4)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    head = md.split("## Verdict\n\n")[1].split("\n")[0]
    assert head.startswith("Did not learn: the training reward was 0 at every one of 4 steps")
    assert "bound by training: 94% of it" in head and "Speculation did not speed this run up" in head
    assert "No checkpoint under" in head
    assert (tmp_path / "report" / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert "| `ppo/entropy` | 5.7 | entropy of the policy on the trained tokens |" in md


def test_reward_band_is_the_rolling_mean_and_std():
    # window 3 over 0, 1, 0, 1: means 0, 1/2, 1/3, 2/3; population std 0, 1/2, sqrt(2/9), sqrt(2/9)
    means, stds = plots.reward_band([0.0, 1.0, 0.0, 1.0], 3)
    assert means == [0.0, 0.5, 1 / 3, 2 / 3]
    assert [round(s, 12) for s in stds] == [0.0, 0.5, round((2 / 9) ** 0.5, 12), round((2 / 9) ** 0.5, 12)]
    assert [plots.band_window(n) for n in (1, 2, 10, 45)] == [1, 2, 3, 5]


def test_identical_series_share_a_line():
    keys = ["ppo/version_lag/mean", "ppo/version_lag/max", "staleness/max"]
    same = [{"step": s, **dict.fromkeys(keys, 0.0)} for s in range(3)]
    assert [label for label, _, _ in plots.distinct_series(same, keys)] == [" = ".join(keys)]
    same[1]["ppo/version_lag/max"] = 1.0
    labels = [label for label, _, _ in plots.distinct_series(same, keys)]
    assert labels == ["ppo/version_lag/mean = staleness/max", "ppo/version_lag/max"]


def test_episodes_title():
    assert plots.episodes_title([{"step": 0, "episode/turns": 1.0}]) == "episodes"
    assert plots.episodes_title([{"step": 0, "episode/turns": 2.5}]) == "multi-turn episodes"
