"""The report's opening verdict: did the run learn, where did the step's time go, did speculation
pay, and where is the checkpoint -- sentences computed from ``metrics.jsonl``; and :data:`GLOSSARY`,
what each metric of the report means.

Noise. A held-out eval scores the same ``n`` prompts (``min(controller.eval_size, task.n_eval)``),
each reward in [0, 1]: the variance of one reward is at most ``p(1 - p)``, so the first → last change
is called real when it exceeds ``Z·sqrt(p₀(1-p₀)/n + p₁(1-p₁)/n)`` (each p kept within [1/n, 1 - 1/n]). Without one, the training reward's
trend: the means of the first and last ``k = ceil(n / 5)`` steps, against ``Z·σ·sqrt(2/k)`` where the
step-to-step noise ``σ = sqrt(mean(Δ²) / 2)`` comes from successive differences (a steady trend
barely moves it).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from areal_npu import names
from areal_npu.report.series import human, series, start_end

Z = 2.0  # a change counts when it exceeds Z standard errors
SPEEDUP_EPS = 0.02  # a step speed-up bound under 1 + this: speculation did not speed the run up

PHASE_WORDS = {
    "data": "data loading",
    "prepare": "batch preparation",
    "gen": "generation (waiting for the batch of rollouts)",
    "prox": "recomputing log-probs",
    "train": "training",
    "sync": "weight sync",
}

GLOSSARY = {
    names.REWARD_MEAN: "mean reward of the step's trajectories",
    names.REWARD_MIN: "lowest reward in the step",
    names.REWARD_MAX: "highest reward in the step",
    names.REWARD_SOLVED: "fraction of trajectories with reward ≥ 1",
    names.REWARD_SUSPICIOUS: "fraction whose diff adds exit hooks or runner-like output (grader gaming?)",
    names.EVAL_REWARD: "mean reward on held-out prompts, one sample each",
    names.EPISODES_PER_MIN: "episodes finished per minute of step time",
    names.episode_key("turns"): "model turns per episode",
    names.episode_key("tokens"): "tokens per episode (prompt, observations and the model's)",
    names.episode_key("submitted"): "share of episodes that submitted an answer",
    names.episode_key("pass_rate"): "share of the hidden tests that passed",
    names.episode_key("format_errors"): "malformed actions per episode",
    names.episode_key("env_start_s"): "seconds to start an episode's environment",
    names.episode_p95_key("env_start_s"): "95th percentile of that over the step's episodes",
    names.episode_key("grade_s"): "seconds to grade an episode",
    names.episode_p95_key("grade_s"): "95th percentile of that over the step's episodes",
    names.SPEC_ACCEPT_RATE: "accepted / drafted tokens",
    names.SPEC_MEAN_ACCEPTED_LEN: "tokens per verify step (1 = no draft accepted)",
    names.SPEC_K: "draft length (0 = speculation off)",
    names.TOKENS_PER_BUSY_S: "generated tokens per second an engine had work",
    names.BEHAVE_IMP_WEIGHT_MEAN: "π_prox / π_behave: how far the sampled tokens' policy lags (1 = none)",
    names.VERSION_LAG_MEAN: "weight versions between generating a token and training on it",
    names.VERSION_LAG_MAX: "largest such lag in the step",
    names.STALENESS_MAX: "the controller's count of that lag",
    names.STEP_TIME: "wall seconds of one training step",
    names.STEP_SPEEDUP_BOUND: "most the step gained from speculation (drafts taken as free); 1 = none",
    names.GEN_FRACTION: "share of the step spent waiting for rollouts",
    names.PPO_LOSS: "policy-gradient loss",
    names.TRAIN_GRAD_NORM: "gradient norm before clipping",
    names.PPO_ENTROPY: "entropy of the policy on the trained tokens",
    **{names.timing_key(p): f"seconds per step in {w}" for p, w in PHASE_WORDS.items()},
    names.timing_key(
        "reward"
    ): "workflows' generation + grading, summed over concurrent groups (overlaps the step)",
    names.timing_key("eval"): "held-out eval, after the step's clock stops",
}


def eval_prompts(config: dict | None) -> int | None:
    """Prompts per held-out eval: ``min(controller.eval_size, task.n_eval)`` of the run's config."""
    config = config if isinstance(config, dict) else {}
    sizes = [(config.get(a) or {}).get(b) for a, b in (("controller", "eval_size"), ("task", "n_eval"))]
    sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    return min(sizes) if sizes else None


def _judge(change: float, noise: float) -> str:
    return "Learned" if change > noise else "Got worse" if change < -noise else "Did not clearly learn"


def learning(rows: list[dict], config: dict | None = None) -> str:
    """One sentence: the held-out eval's first → last when its noise is known, else the training trend."""
    eval_steps, ev = series(rows, names.EVAL_REWARD)
    n = eval_prompts(config)
    if len(ev) >= 2 and max(ev) == min(ev):
        return (
            f"Did not learn: held-out reward {human(ev[0])} at every one of {len(ev)} evals "
            f"(steps {eval_steps[0]}–{eval_steps[-1]})."
        )
    if len(ev) >= 2 and n:
        p0, p1 = (min(1 - 1 / n, max(1 / n, p)) for p in (ev[0], ev[-1]))  # no zero noise at 0 or 1
        noise = Z * math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n)
        return (
            f"{_judge(ev[-1] - ev[0], noise)}: held-out reward {human(ev[0])} → {human(ev[-1])} "
            f"(steps {eval_steps[0]}–{eval_steps[-1]}, {n} prompts, noise ±{human(noise)})."
        )
    _, reward = series(rows, names.REWARD_MEAN)
    if not reward:
        return f"Whether it learned is unknown: no {names.REWARD_MEAN} in metrics.jsonl."
    if max(reward) == min(reward):
        return (
            f"Did not learn: the training reward was {human(reward[0])} at every one of {len(reward)} steps, "
            "so the groups gave no learning signal."
        )
    start, end = start_end(reward)
    if len(reward) < 3:
        return f"Too few steps to tell whether it learned: training reward {human(start)} → {human(end)}."
    k = max(1, math.ceil(len(reward) / 5))
    sigma = math.sqrt(statistics.fmean((b - a) ** 2 for a, b in zip(reward, reward[1:])) / 2)
    noise = Z * sigma * math.sqrt(2 / k)
    return (
        f"{_judge(end - start, noise)}: training reward {human(start)} → {human(end)} (first and last "
        f"{k} of {len(reward)} steps; noise ±{human(noise)})."
    )


def time_spent(rows: list[dict]) -> str | None:
    """Which phase bound the step: the largest of the median phase times."""
    medians = {}
    for phase in names.PHASES:
        _, seconds = series(rows, names.timing_key(phase))
        if seconds:
            medians[phase] = statistics.median(seconds)
    if not medians:
        return None
    _, step_s = series(rows, names.STEP_TIME)
    step = statistics.median(step_s) if step_s else sum(medians.values())
    phase = max(medians, key=medians.get)
    share = medians[phase] / step if step > 0 else 0.0
    text = f"The step (median {human(step)} s) was bound by {PHASE_WORDS[phase]}: {share:.0%} of it"
    _, side = series(rows, names.timing_key("reward"))
    if phase != "gen" and side and medians.get("gen", 0.0) < 0.1 * step < statistics.median(side):
        text += (
            f"; rollouts ran ahead of it (their generation and grading, {human(statistics.median(side))} s "
            "summed over concurrent groups, overlapped training)"
        )
    return text + "."


def speculation(rows: list[dict]) -> str | None:
    """Whether drafting paid: the median step speed-up bound over the steps that speculated."""
    by_step = {r["step"]: r for r in rows}
    k_steps, ks = series(rows, names.SPEC_K)
    if not k_steps:
        return None
    spec = [s for s, k in zip(k_steps, ks) if k > 0]
    if not spec:
        return "Speculation was off."
    k = statistics.median_low(int(by_step[s][names.SPEC_K]) for s in spec)

    def median_of(key):
        vals = [v for s in spec if isinstance(v := by_step[s].get(key), (int, float))]
        return statistics.median(vals) if vals else None

    bound, alpha = median_of(names.STEP_SPEEDUP_BOUND), median_of(names.SPEC_MEAN_ACCEPTED_LEN)
    per_verify = f"{human(alpha)} tokens per verify step at k = {k}" if alpha else f"k = {k}"
    if bound is None:
        return f"Speculation ran ({per_verify}); its speed-up was not measured."
    if bound < 1 + SPEEDUP_EPS:
        return f"Speculation did not speed this run up ({per_verify}; step speed-up bound ×{human(bound)})."
    gen_saved = f"{1 - 1 / alpha:.0%} of generation time and " if alpha and alpha > 1 else ""
    return (
        f"Speculation saved at most {gen_saved}{1 - 1 / bound:.0%} of the step ({per_verify}, "
        "drafts taken as free)."
    )


def checkpoint(run_dir: Path) -> str:
    """Where the trainer's last weights are: ``checkpoints/latest``, else the newest ``step_<N>``."""
    root = Path(run_dir) / "checkpoints"
    steps = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    marker = root / "latest"
    named = root / marker.read_text().strip() if marker.is_file() else None
    path = named if named is not None and named.is_dir() else (steps[-1] if steps else None)
    if path is None:
        return f"No checkpoint under {root} (controller.checkpoint_every)."
    return f"Checkpoint: {path} (a Hugging Face model directory)."


def sentences(rows: list[dict], run_dir: Path, config: dict | None = None) -> list[str]:
    """The verdict's sentences, in order: learning, time, speculation, checkpoint."""
    parts = [learning(rows, config), time_spent(rows), speculation(rows), checkpoint(run_dir)]
    return [p for p in parts if p]
