"""``areal-npu report RUN_DIR [--out DIR]``: PNG plots and a markdown summary of a run directory.

Reads ``<run_dir>/metrics.jsonl`` (see :mod:`areal_npu.metrics`) and ``<run_dir>/config.yaml`` when
present, and writes into ``--out`` (default ``<run_dir>/report``) one PNG per group of metrics that
has data, and ``report.md``:

* reward: start vs end, each the mean of ``reward/mean`` over the first / last ``ceil(n / 5)`` of
  the ``n`` steps that report it (~20 %), and their difference;
* final speculative acceptance, mean ``behave_imp_weight``, total time (sum of ``timing/step_s``;
  wall clock from the first to the last line);
* the last step's key metrics as a table, links to the PNGs, and which groups had no data.

Plots are drawn on ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no display).
Exit codes: 0, or 2 when the metrics file is missing, empty or unreadable.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_npu import names

EXIT_INPUT = 2

# The last step's table: these keys, in this order, when present.
KEY_METRICS = (
    names.REWARD_MEAN,
    names.REWARD_MIN,
    names.REWARD_MAX,
    # multi-turn agents (meta["stats"] of their trajectories, averaged over the step's episodes)
    *(names.episode_key(k) for k in ("turns", "tokens", "submitted", "pass_rate", "format_errors")),
    names.EVAL_REWARD,
    names.SPEC_ACCEPT_RATE,
    names.SPEC_MEAN_ACCEPTED_LEN,
    names.SPEC_K,
    names.TOKENS_PER_BUSY_S,
    names.BEHAVE_IMP_WEIGHT_MEAN,
    names.VERSION_LAG_MEAN,
    names.VERSION_LAG_MAX,
    names.STALENESS_MAX,
    names.STEP_TIME,
    *(names.timing_key(p) for p in names.PHASES + names.SIDE_PHASES),
    names.STEP_SPEEDUP_BOUND,
    names.GEN_FRACTION,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory with metrics.jsonl (and config.yaml)")
    p.add_argument(
        "--out", metavar="DIR", help="where to write the PNGs and report.md (default RUN_DIR/report)"
    )


# --- series --------------------------------------------------------------------------------------------


def _value(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the rows where it is a finite number."""
    pairs = [(r["step"], v) for r in rows if (v := _value(r.get(key))) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def indexed_keys(rows: list[dict], pattern: str) -> list[tuple[int, str]]:
    """Keys matching ``pattern`` (one integer group), as (index, key) sorted by index."""
    rx = re.compile(pattern)
    found = {m.group(0): int(m.group(1)) for r in rows for k in r if (m := rx.fullmatch(k))}
    return sorted((i, k) for k, i in found.items())


# --- plots ---------------------------------------------------------------------------------------------


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


def plot_lines(rows: list[dict], panels: list[Panel], path: Path, title: str) -> Path | None:
    """One subplot per panel that has data, a line per key; ``None`` (nothing written) when none has."""
    panels = [p for p in panels if any(series(rows, k)[0] for k in p.keys)]
    if not panels:
        return None
    fig, axes = _figure(len(panels))
    for ax, panel in zip(axes, panels):
        for key in panel.keys:
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def plot_reward(rows: list[dict], path: Path) -> Path | None:
    steps, mean = series(rows, names.REWARD_MEAN)
    if not steps:
        return None
    fig, (ax,) = _figure(1)
    ax.plot(steps, mean, label=names.REWARD_MEAN, color="C0")
    lo, hi = names.REWARD_MIN, names.REWARD_MAX
    band = [r for r in rows if _value(r.get(lo)) is not None and _value(r.get(hi)) is not None]
    if band:
        ax.fill_between(
            [r["step"] for r in band],
            [r[lo] for r in band],
            [r[hi] for r in band],
            alpha=0.25,
            color="C0",
            label="min–max",
        )
    eval_steps, eval_mean = series(rows, names.EVAL_REWARD)
    if eval_steps:
        ax.plot(eval_steps, eval_mean, "o-", label=f"{names.EVAL_REWARD} (held-out prompts)", color="C3")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
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
    steps = [r["step"] for r in rows if any(_value(r.get(k)) is not None for k in keys)]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    width = 0.8 * (min(gaps) if gaps else 1)
    fig, (ax,) = _figure(1)
    by_step = {r["step"]: r for r in rows}
    bottom = [0.0] * len(steps)
    for i, key in enumerate(keys):
        heights = [_value(by_step[s].get(key)) or 0.0 for s in steps]
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


def write_plots(rows: list[dict], out: Path) -> tuple[dict[str, Path], list[str]]:
    """Write every plot that has data; returns ({name: path}, [names of plots without data])."""
    pos = [k for _, k in indexed_keys(rows, names.SPEC_ACCEPT_RATE_POS_PATTERN)]
    mtp_loss = [k for _, k in indexed_keys(rows, names.MTP_LOSS_DEPTH_PATTERN)]
    mtp_acc = [k for _, k in indexed_keys(rows, names.MTP_ACC_DEPTH_PATTERN)]
    ppo_w = [f"{names.BEHAVE_IMP_WEIGHT}/{s}" for s in ("mean", "min", "max")]
    ep = names.episode_key
    builders = {
        "reward": lambda p: plot_reward(rows, p),
        "spec_accept": lambda p: plot_lines(
            rows,
            [
                Panel("acceptance rate", [names.SPEC_ACCEPT_RATE, *pos], "P(accepted)"),
                Panel("mean accepted length", [names.SPEC_MEAN_ACCEPTED_LEN], "tokens / verify step"),
            ],
            p,
            "speculative decoding",
        ),
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
            [
                Panel(
                    "version lag",
                    [names.VERSION_LAG_MEAN, names.VERSION_LAG_MAX, names.STALENESS_MAX],
                    "versions",
                )
            ],
            p,
            "",
        ),
        "episodes": lambda p: plot_lines(
            rows,
            [
                Panel("turns", [ep("turns")], "model turns / episode"),
                Panel("tokens", [ep("tokens"), ep("model_tokens")], "tokens / episode"),
                Panel("hidden tests", [ep("pass_rate"), names.REWARD_SOLVED], "fraction"),
                Panel("actions", [ep("format_errors"), ep("submitted")], "per episode"),
            ],
            p,
            "multi-turn episodes",
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
        if path is None:
            missing.append(name)
        else:
            written[name] = path
    return written, missing


# --- summary -------------------------------------------------------------------------------------------


def start_end(values: list[float]) -> tuple[float, float]:
    """Means of the first and last ``ceil(n / 5)`` values."""
    k = max(1, math.ceil(len(values) / 5))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.4f}"
    return str(v)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{seconds:.1f} s ({s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d})"


def summary_markdown(
    rows: list[dict], run_dir: Path, plots: dict[str, Path], missing_plots: list[str], config_text: str | None
) -> str:
    name = run_dir.resolve().name
    if config_text:
        try:
            import yaml

            cfg = yaml.safe_load(config_text)
            if isinstance(cfg, dict) and cfg.get("name"):
                name = str(cfg["name"])
        except Exception:  # a config we cannot parse is still shown verbatim below
            pass
    steps = [r["step"] for r in rows]
    md = [
        f"# Run report: {name}",
        "",
        f"Run directory: `{run_dir}`  ",
        f"Steps: {steps[0]}–{steps[-1]} ({len(rows)} logged)",
        "",
    ]
    missing_summary = []

    md.append("## Summary")
    md.append("")
    _, reward = series(rows, names.REWARD_MEAN)
    if reward:
        start, end = start_end(reward)
        k = max(1, math.ceil(len(reward) / 5))
        md.append(
            f"- reward (mean of first/last {k} of {len(reward)} steps): start {start:.4f}, end {end:.4f}, change {end - start:+.4f}"
        )
    else:
        missing_summary.append(names.REWARD_MEAN)
    eval_steps, eval_reward = series(rows, names.EVAL_REWARD)
    if len(eval_reward) >= 2:
        md.append(
            f"- held-out eval reward: step {eval_steps[0]} {eval_reward[0]:.4f} -> step {eval_steps[-1]} "
            f"{eval_reward[-1]:.4f} (change {eval_reward[-1] - eval_reward[0]:+.4f})"
        )
    acc_steps, acc = series(rows, names.SPEC_ACCEPT_RATE)
    if acc:
        line = f"- final speculative acceptance (step {acc_steps[-1]}): {acc[-1]:.4f}"
        _, length = series(rows, names.SPEC_MEAN_ACCEPTED_LEN)
        if length:
            line += f", mean accepted length {length[-1]:.4f}"
        md.append(line)
    else:
        missing_summary.append(names.SPEC_ACCEPT_RATE)
    _, imp = series(rows, names.BEHAVE_IMP_WEIGHT_MEAN)
    if imp:
        md.append(f"- mean behave_imp_weight: {sum(imp) / len(imp):.4f} over {len(imp)} steps")
    else:
        missing_summary.append(names.BEHAVE_IMP_WEIGHT_MEAN)
    _, step_s = series(rows, names.STEP_TIME)
    if step_s:
        md.append(f"- total step time (sum of timing/step_s): {_duration(sum(step_s))}")
    else:
        missing_summary.append(names.STEP_TIME)
    _, wall = series(rows, "time")
    if len(wall) >= 2:
        md.append(f"- wall clock, first to last logged step: {_duration(wall[-1] - wall[0])}")
    md.append("")

    last = rows[-1]
    table = [(k, last[k]) for k in KEY_METRICS if _value(last.get(k)) is not None]
    if table:
        md += [f"## Last step ({last['step']})", "", "| metric | value |", "|---|---|"]
        md += [f"| `{k}` | {_fmt(v)} |" for k, v in table]
        md.append("")

    decisions = read_spec_decisions(run_dir)
    if decisions:
        md += ["## Draft-length decisions (adaptive speculation)", "", "| step | k | reason |", "|---|---|---|"]
        md += [f"| {d['step']} | {d['k_from']} → {d['k_to']} | {d['reason']} |" for d in decisions[-MAX_DECISIONS:]]
        if len(decisions) > MAX_DECISIONS:
            md.append(f"\n(last {MAX_DECISIONS} of {len(decisions)}; all in `spec_decisions.jsonl`)")
        md.append("")

    if plots:
        md += ["## Plots", ""]
        for plot_name, path in plots.items():
            md += [f"### {plot_name}", "", f"![{plot_name}]({path.name})", ""]

    if missing_plots or missing_summary:
        md += ["## Missing from metrics.jsonl", ""]
        if missing_plots:
            md.append(f"- plots without data (not written): {', '.join(missing_plots)}")
        if missing_summary:
            md.append(f"- summary keys: {', '.join(f'`{k}`' for k in missing_summary)}")
        md.append("")

    if config_text is not None:
        md += [
            "## Config",
            "",
            "<details><summary>config.yaml</summary>",
            "",
            "```yaml",
            config_text.rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    return "\n".join(md)


MAX_DECISIONS = 20


def read_spec_decisions(run_dir: Path) -> list[dict]:
    """``spec_decisions.jsonl`` (written by the adaptive-speculation driver); unreadable lines skipped."""
    path = run_dir / "spec_decisions.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"step", "k_from", "k_to", "reason"} <= row.keys():
            out.append(row)
    return out


def build_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the plots and ``report.md``; returns the paths written. Raises ``MetricsError``."""
    from areal_npu.metrics import read_metrics

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots, missing = write_plots(rows, out)
    config = run_dir / "config.yaml"
    config_text = config.read_text() if config.is_file() else None
    report = out / "report.md"
    report.write_text(summary_markdown(rows, run_dir, plots, missing, config_text))
    return [*plots.values(), report]


def run(args: argparse.Namespace) -> int:
    from areal_npu.metrics import MetricsError

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"areal-npu report: {run_dir} is not a directory", file=sys.stderr)
        return EXIT_INPUT
    try:
        paths = build_report(run_dir, args.out)
    except MetricsError as exc:
        print(f"areal-npu report: {exc}", file=sys.stderr)
        return EXIT_INPUT
    for path in paths:
        print(path)
    return 0
