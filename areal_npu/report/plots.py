"""The PNGs of ``areal-npu report``: one per group of metrics that has data.

Drawn on ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no display).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from areal_npu import names
from areal_npu.report.series import backend_keys, indexed_keys, series, value
from areal_npu.speculation.context import pooled_by_bucket


@dataclass
class Panel:
    title: str
    keys: list[str]
    ylabel: str = ""


def _figure(n_panels: int):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5 * n_panels, 4.2))
    return fig, [fig.add_subplot(1, n_panels, i + 1) for i in range(n_panels)]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    return path


def distinct_series(rows: list[dict], keys: list[str]) -> list[tuple[str, list[int], list[float]]]:
    """(label, steps, values) per key with data; keys whose series are identical share one line,
    labelled ``a = b`` (a run with one version of lag logs the same numbers under three keys)."""
    out: list[tuple[str, list[int], list[float]]] = []
    for key in keys:
        steps, values = series(rows, key)
        if not steps:
            continue
        same = next((i for i, (_, s, v) in enumerate(out) if s == steps and v == values), None)
        if same is None:
            out.append((key, steps, values))
        else:
            out[same] = (f"{out[same][0]} = {key}", steps, values)
    return out


def plot_lines(rows: list[dict], panels: list[Panel], path: Path, title: str) -> Path | None:
    """One subplot per panel that has data, a line per distinct series; ``None`` (nothing written)
    when no panel has data."""
    panels = [p for p in panels if any(series(rows, k)[0] for k in p.keys)]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, panel in zip(axes, panels):
        for label, steps, values in distinct_series(rows, panel.keys):
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def band_window(n: int) -> int:
    """Steps in the reward plot's rolling window: a tenth of the run, at least 3 (at most ``n``)."""
    return max(1, min(n, max(3, math.ceil(n / 10))))


def reward_band(values: list[float], window: int) -> tuple[list[float], list[float]]:
    """Rolling mean and population standard deviation of the last ``window`` values at each step
    (fewer at the start): how much the step's mean reward moves from step to step. The logged
    min–max would span 0–1 on almost every step of a run with 0/1 rewards."""
    means, stds = [], []
    for i in range(len(values)):
        w = values[max(0, i - window + 1) : i + 1]
        means.append(statistics.fmean(w))
        stds.append(statistics.pstdev(w))
    return means, stds


def plot_reward(rows: list[dict], path: Path) -> Path | None:
    steps, mean = series(rows, names.REWARD_MEAN)
    if not steps:
        return None
    fig, (ax,) = _figure(1)
    ax.plot(steps, mean, ".", color="C0", alpha=0.5, label=f"{names.REWARD_MEAN} (each step)")
    w = band_window(len(mean))
    rolling, std = reward_band(mean, w)
    ax.plot(steps, rolling, color="C0", label=f"mean of the last {w} steps")
    lo, hi = [m - s for m, s in zip(rolling, std)], [m + s for m, s in zip(rolling, std)]
    ax.fill_between(steps, lo, hi, alpha=0.2, color="C0", label="± their standard deviation")
    for key, style, color, label in (
        (names.REWARD_SOLVED, "-", "C2", "solved (reward ≥ 1)"),
        (names.REWARD_SUSPICIOUS, "--", "C1", "suspicious (gaming the grader?)"),
        (names.EVAL_REWARD, "o-", "C3", "held-out prompts"),
    ):
        k_steps, k_values = series(rows, key)
        if k_steps:
            ax.plot(k_steps, k_values, style, color=color, label=f"{key}: {label}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / fraction of trajectories")
    ax.set_title("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_step_time(rows: list[dict], path: Path) -> Path | None:
    """The step's phases stacked (they add up to the step), side phases as dashed lines (see
    :mod:`areal_npu.names`: they overlap the step or follow it)."""
    keys = [names.timing_key(p) for p in names.PHASES if series(rows, names.timing_key(p))[0]]
    side = [names.timing_key(p) for p in names.SIDE_PHASES if series(rows, names.timing_key(p))[0]]
    if not keys and not side:
        return None
    steps = [r["step"] for r in rows if any(value(r.get(k)) is not None for k in keys)]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    width = 0.8 * (min(gaps) if gaps else 1)
    fig, (ax,) = _figure(1)
    by_step = {r["step"]: r for r in rows}
    bottom = [0.0] * len(steps)
    for i, key in enumerate(keys):
        heights = [value(by_step[s].get(key)) or 0.0 for s in steps]
        ax.bar(steps, heights, width=width, bottom=bottom, label=key, color=f"C{i}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, key in enumerate(side, start=len(keys)):
        ax.plot(*series(rows, key), ls="--", lw=1, color=f"C{i}", label=f"{key} (not in the step)")
    total_steps, total = series(rows, names.STEP_TIME)
    if total_steps:
        ax.plot(total_steps, total, color="k", lw=1, label=names.STEP_TIME)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("step time by phase")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_spec_context(rows: list[dict], path: Path) -> Path | None:
    """Acceptance of each draft position, and the accepted length, against the context bucket."""
    by_bucket = pooled_by_bucket(rows)
    if not by_bucket:
        return None
    labels = list(by_bucket)
    depth = max(sum(s.startswith("accept_rate_pos") for s in stats) for stats in by_bucket.values())
    fig, (ax, ax_len) = _figure(2)
    for i in range(depth):
        ys = [by_bucket[b].get(f"accept_rate_pos{i}", math.nan) for b in labels]
        ax.plot(labels, ys, marker="o", label=f"draft position {i + 1} (u_{i})")
    ax.set_title("acceptance by context length")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("P(accepted) over the steps that drafted it")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax_len.bar(labels, [by_bucket[b].get("mean_accepted_len", math.nan) for b in labels], color="C0")
    ax_len.set_title("mean accepted length")
    ax_len.set_xlabel("context (tokens)")
    ax_len.set_ylabel("tokens / verify step")
    ax_len.grid(alpha=0.3, axis="y")
    fig.suptitle("speculative decoding by context length (drafts-weighted over the run)")
    return _save(fig, path)


# drawn only for runs that log their keys, not listed as missing: the shell agent on task environments
# (a run from before them renders as it did), per-episode stats (a single-turn run has none), and
# acceptance by context (engines without per-request statistics: vLLM 0.23)
OPTIONAL_PLOTS = ("episode_rate", "env_latency", "episodes", "spec_context")


def episodes_title(rows: list[dict]) -> str:
    """``multi-turn episodes`` when some step averaged more than one model turn, else ``episodes``."""
    _, turns = series(rows, names.episode_key("turns"))
    return "multi-turn episodes" if turns and max(turns) > 1 else "episodes"


def write_plots(rows: list[dict], out: Path) -> tuple[dict[str, Path], list[str]]:
    """Write every plot that has data; returns ({name: path}, [names of plots without data])."""
    pos = [k for _, k in indexed_keys(rows, names.SPEC_ACCEPT_RATE_POS_PATTERN)]
    mtp_loss = [k for _, k in indexed_keys(rows, names.MTP_LOSS_DEPTH_PATTERN)]
    mtp_acc = [k for _, k in indexed_keys(rows, names.MTP_ACC_DEPTH_PATTERN)]
    ppo_w = [f"{names.BEHAVE_IMP_WEIGHT}/{s}" for s in ("mean", "min", "max")]
    ep, p95 = names.episode_key, names.episode_p95_key
    latency_titles = {"env_start_s": "environment start", "grade_s": "grading"}
    lag = [names.VERSION_LAG_MEAN, names.VERSION_LAG_MAX, names.STALENESS_MAX]
    builders = {
        "reward": lambda p: plot_reward(rows, p),
        "training": lambda p: plot_lines(
            rows,
            [
                Panel("policy loss", [names.PPO_LOSS], "loss"),
                Panel("gradient norm (before clipping)", [names.TRAIN_GRAD_NORM], "‖g‖"),
                Panel("entropy of the trained tokens", [names.PPO_ENTROPY], "nats / token"),
            ],
            p,
            "training",
        ),
        "spec_accept": lambda p: plot_lines(
            rows,
            [
                Panel("acceptance rate", [names.SPEC_ACCEPT_RATE, *pos], "P(accepted)"),
                Panel("mean accepted length", [names.SPEC_MEAN_ACCEPTED_LEN], "tokens / verify step"),
            ],
            p,
            "speculative decoding",
        ),
        "spec_context": lambda p: plot_spec_context(rows, p),
        "mtp": lambda p: plot_lines(
            rows,
            [Panel("MTP loss", mtp_loss, "loss"), Panel("MTP accuracy", mtp_acc, "accuracy")],
            p,
            "MTP head",
        ),
        "imp_weight": lambda p: plot_lines(
            rows, [Panel("behave_imp_weight", ppo_w, "π_prox / π_behave")], p, ""
        ),
        "version_lag": lambda p: plot_lines(
            rows,
            [Panel("version lag (series that coincide share a line)", lag, "versions")],
            p,
            "",
        ),
        "episodes": lambda p: plot_lines(
            rows,
            [
                Panel("turns", [ep("turns")], "model turns / episode"),
                Panel("tokens", [ep("tokens"), ep("model_tokens")], "tokens / episode"),
                Panel("hidden tests", [ep("pass_rate")], "fraction"),
                Panel(
                    "actions",
                    [ep(k) for k in ("format_errors", "truncated_observations", *names.SEGMENT_STATS)],
                    "per episode",
                ),
                Panel("how episodes ended", [ep(k) for k in names.EPISODE_ENDS], "share of episodes"),
            ],
            p,
            episodes_title(rows),
        ),
        "episode_rate": lambda p: plot_lines(
            rows,
            [
                Panel("episodes per minute", [names.EPISODES_PER_MIN], "episodes / min of step time"),
                Panel("environment backend", [k for _, k in backend_keys(rows)], "episodes / step"),
            ],
            p,
            "episodes",
        ),
        "env_latency": lambda p: plot_lines(
            rows,
            [
                Panel(latency_titles.get(n, n), [ep(n), p95(n)], "seconds / episode")
                for n in names.LATENCY_STATS
            ],
            p,
            "environment latency (mean and p95 over the step's episodes)",
        ),
        "step_time": lambda p: plot_step_time(rows, p),
        "perf": lambda p: plot_lines(
            rows,
            [
                Panel("step speed-up bound", [names.STEP_SPEEDUP_BOUND], "×"),
                Panel("generation fraction", [names.GEN_FRACTION], "fraction of step"),
                Panel("draft length", [names.SPEC_K], "k"),
                Panel("generation throughput", [names.TOKENS_PER_BUSY_S], "tokens / engine-busy s"),
            ],
            p,
            "",
        ),
    }
    written, missing = {}, []
    for name, build in builders.items():
        path = build(out / f"{name}.png")
        if path is not None:
            written[name] = path
        elif name not in OPTIONAL_PLOTS:
            missing.append(name)
    return written, missing
