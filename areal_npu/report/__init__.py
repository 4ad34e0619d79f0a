"""``areal-npu report RUN_DIR [--out DIR]``: PNG plots and a markdown summary of a run directory.

Reads ``<run_dir>/metrics.jsonl`` (see :mod:`areal_npu.metrics`) and ``<run_dir>/config.yaml`` when
present, and writes into ``--out`` (default ``<run_dir>/report``) one PNG per group of metrics that
has data, and ``report.md``:

* reward: start vs end, each the mean of ``reward/mean`` over the first / last ``ceil(n / 5)`` of
  the ``n`` steps that report it (~20 %), and their difference;
* final speculative acceptance, mean ``behave_imp_weight``, total time (sum of ``timing/step_s``;
  wall clock from the first to the last line);
* episodes per minute, environment start and grading seconds, and the environment backends the
  episodes ran on (episodes, steps; one without isolation flagged): the plots of
  :data:`~areal_npu.report.plots.OPTIONAL_PLOTS`;
* the last step's key metrics as a table with what each means, links to the PNGs, and which groups
  had no data.

``report.md`` opens with a verdict (:mod:`areal_npu.report.verdict`: did it learn, which phase bound
the step, whether speculation paid, the checkpoint). The plots are :mod:`areal_npu.report.plots`.
Exit codes: 0, or 2 when the metrics file is missing, empty or unreadable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from areal_npu import names
from areal_npu.report.plots import write_plots
from areal_npu.report.series import backend_keys, duration, human, series, signed, start_end, value
from areal_npu.report.verdict import GLOSSARY, sentences

EXIT_INPUT = 2

# The last step's table: these keys, in this order, when present.
KEY_METRICS = (
    names.REWARD_MEAN,
    names.REWARD_MIN,
    names.REWARD_MAX,
    names.REWARD_SOLVED,
    names.REWARD_SUSPICIOUS,
    # multi-turn agents (meta["stats"] of their trajectories, averaged over the step's episodes)
    *(names.episode_key(k) for k in ("turns", "tokens", "submitted", "pass_rate", "format_errors")),
    names.EPISODES_PER_MIN,
    *(k for n in names.LATENCY_STATS for k in (names.episode_key(n), names.episode_p95_key(n))),
    names.EVAL_REWARD,
    names.SPEC_ACCEPT_RATE,
    names.SPEC_MEAN_ACCEPTED_LEN,
    names.SPEC_K,
    names.TOKENS_PER_BUSY_S,
    names.PPO_LOSS,
    names.TRAIN_GRAD_NORM,
    names.PPO_ENTROPY,
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


# --- summary -------------------------------------------------------------------------------------------


def summary_markdown(
    rows: list[dict], run_dir: Path, plots: dict[str, Path], missing_plots: list[str], config_text: str | None
) -> str:
    name, cfg = run_dir.resolve().name, None
    if config_text:
        try:
            import yaml

            cfg = yaml.safe_load(config_text)
            if isinstance(cfg, dict) and cfg.get("name"):
                name = str(cfg["name"])
        except Exception:  # a config we cannot parse is still shown verbatim below
            cfg = None
    steps = [r["step"] for r in rows]
    md = [
        f"# Run report: {name}",
        "",
        f"Run directory: `{run_dir}`  ",
        f"Steps: {steps[0]}–{steps[-1]} ({len(rows)} logged)",
        "",
        "## Verdict",
        "",
        " ".join(sentences(rows, run_dir, cfg)),
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
            f"- reward (mean of first/last {k} of {len(reward)} steps): start {human(start)}, end {human(end)}, change {signed(end - start)}"
        )
    else:
        missing_summary.append(names.REWARD_MEAN)
    eval_steps, eval_reward = series(rows, names.EVAL_REWARD)
    if len(eval_reward) >= 2:
        md.append(
            f"- held-out eval reward: step {eval_steps[0]} {human(eval_reward[0])} → step {eval_steps[-1]} "
            f"{human(eval_reward[-1])} (change {signed(eval_reward[-1] - eval_reward[0])})"
        )
    acc_steps, acc = series(rows, names.SPEC_ACCEPT_RATE)
    if acc:
        line = f"- final speculative acceptance (step {acc_steps[-1]}): {human(acc[-1])}"
        _, length = series(rows, names.SPEC_MEAN_ACCEPTED_LEN)
        if length:
            line += f", mean accepted length {human(length[-1])}"
        md.append(line)
    else:
        missing_summary.append(names.SPEC_ACCEPT_RATE)
    _, imp = series(rows, names.BEHAVE_IMP_WEIGHT_MEAN)
    if imp:
        md.append(f"- mean behave_imp_weight: {human(sum(imp) / len(imp))} over {len(imp)} steps")
    else:
        missing_summary.append(names.BEHAVE_IMP_WEIGHT_MEAN)
    _, step_s = series(rows, names.STEP_TIME)
    if step_s:
        md.append(f"- total step time (sum of timing/step_s): {duration(sum(step_s))}")
    else:
        missing_summary.append(names.STEP_TIME)
    _, wall = series(rows, "time")
    if len(wall) >= 2:
        md.append(f"- wall clock, first to last logged step: {duration(wall[-1] - wall[0])}")
    md += _episode_lines(rows)
    md.append("")

    last = rows[-1]
    keys = [*KEY_METRICS, *(k for _, k in backend_keys(rows))]
    table = [(k, last[k]) for k in keys if value(last.get(k)) is not None]
    if table:
        md += [f"## Last step ({last['step']})", "", "| metric | value | meaning |", "|---|---|---|"]
        md += [f"| `{k}` | {human(v)} | {GLOSSARY.get(k, '')} |" for k, v in table]
        md.append("")

    decisions = read_spec_decisions(run_dir)
    if decisions:
        head = "## Draft-length decisions (adaptive speculation)"
        md += [head, "", "| step | k | reason |", "|---|---|---|"]
        shown = decisions[-MAX_DECISIONS:]
        md += [f"| {d['step']} | {d['k_from']} → {d['k_to']} | {d['reason']} |" for d in shown]
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


def _episode_lines(rows: list[dict]) -> list[str]:
    """Summary lines: episodes per minute, environment latencies, and the environment backends."""
    from areal_npu.agent import env_backends
    from areal_npu.config import ConfigError

    md = []
    _, rate = series(rows, names.EPISODES_PER_MIN)
    if rate:
        md.append(f"- episodes per minute (mean over {len(rate)} steps): {human(sum(rate) / len(rate))}")
    for key, p95_key in ((names.episode_key(n), names.episode_p95_key(n)) for n in names.LATENCY_STATS):
        (_, mean), (_, p95) = series(rows, key), series(rows, p95_key)
        worst = f", largest step p95 {human(max(p95))} s" if p95 else ""
        if mean:
            md.append(f"- `{key}` (mean over {len(mean)} steps): {human(sum(mean) / len(mean))} s{worst}")
    used = []
    for backend, key in backend_keys(rows):
        steps, counts = series(rows, key)  # the controller logs a backend's key only at steps it ran
        if sum(counts) <= 0:
            continue
        try:
            note = "" if env_backends.get(backend).isolated else ", **no isolation**"
        except ConfigError:
            note = ", isolation unknown"  # a backend this version does not know
        used.append(f"{backend} ({sum(counts):g} episodes, steps {steps[0]}–{steps[-1]}{note})")
    if used:
        label = "env backend" if len(used) == 1 else f"env backends (**{len(used)} different**)"
        md.append(f"- {label}: {'; '.join(used)}")
    return md


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
