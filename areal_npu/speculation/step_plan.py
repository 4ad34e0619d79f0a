"""The step model behind ``areal-npu plan`` (:mod:`areal_npu.plan`) and the dry run's step-time
prediction (:mod:`areal_npu.step_estimate`): phase breakdown, step speed-up bound and a draft-length
recommendation, as a :class:`Plan`.

Two sources of numbers:

* a run directory whose ``metrics.jsonl`` (read by :func:`areal_npu.metrics.read_metrics`: a torn
  last line is dropped, a step logged twice counts once) holds one JSON object per step with
  ``timing/<phase>_s`` for the phases of :mod:`areal_npu.names` (``PHASES``, plus the side phases
  shown but not added to the step), ``timing/step_s``, and for the cost model
  ``rollout/batch_size``, ``rollout/tokens_per_s``, the draft length (``rollout/spec_k``, else
  ``rollout/spec_draft_tokens / rollout/spec_drafts``) and acceptance (``rollout/spec_accept_per_pos``
  or the scalars ``rollout/spec_accept_rate_pos<i>`` that :func:`areal_npu.speculation.acceptance.spec_stats`
  writes, else ``rollout/spec_mean_accepted_len``, else ``rollout/spec_accept_rate``) — see
  :mod:`areal_npu.speculation.planner`. A run that cannot calibrate the draft cost (one draft length,
  or no ``rollout/batch_size``: the quickstart's) takes :func:`default_draft_cost` and says so;
* numbers on the command line: autoregressive ``--t-gen``/``--t-step`` (or the phases), a measured
  ``--gen-speedup`` (or ``--t-gen-spec``) at ``--k``, ``--accept`` and/or ``--draft-cost``.

The model's inputs are declared here as command-line arguments (:func:`add_step_arguments`), once:
``areal-npu plan`` adds its own around them, and the dry run states its prediction as the
``areal-npu plan`` command that reproduces it, parsed by the same declaration. Only argparse and
:mod:`areal_npu.names` are imported at module level: ``areal-npu --help`` stays fast.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, field

from areal_npu import names

DEFAULT_MAX_K = 8
DEFAULT_MIN_GAIN = 0.02


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """The step model's inputs (what :func:`plan_from_numbers` / :func:`plan_from_run` read)."""
    for phase in names.PHASES:
        # --t-logprob: NeMo-RL's name for the proximal log-prob phase
        aliases = ("--t-logprob",) if phase == "prox" else ()
        p.add_argument(
            f"--t-{phase}", *aliases, type=float, dest=f"t_{phase}",
            help=f"seconds per step in {phase} (autoregressive)",
        )  # fmt: skip
    p.add_argument("--t-step", type=float, help="seconds per step, autoregressive (default: sum of phases)")
    p.add_argument("--t-gen-spec", type=float, help="generation seconds per step with speculation at --k")
    p.add_argument("--gen-speedup", type=float, help="measured generation speed-up at --k")
    p.add_argument("--k", type=int, help="draft length at which --gen-speedup / --t-gen-spec was measured")
    p.add_argument(
        "--accept",
        help="conditional acceptance: one p (iid) or per position 'p1,p2,...' (deeper positions repeat the last)",
    )
    p.add_argument(
        "--draft-cost",
        type=float,
        help="one draft position (drafting + verifying it) in units of one autoregressive decode step",
    )
    p.add_argument("--batch", type=float, help="running batch to evaluate the cost model at (run dir)")
    p.add_argument(
        "--accept-by-context",
        help="conditional acceptance per context bucket: 'lt4k=0.9,0.8;32k_64k=0.5' (buckets of "
        "areal_npu/speculation/context.py; a run dir's rollout/spec_ctx_* otherwise)",
    )
    p.add_argument(
        "--context-mix",
        help="share of the generated tokens per context bucket: 'lt4k=0.2;4k_16k=0.5;16k_32k=0.3' "
        "(a run dir's token counts per bucket otherwise)",
    )
    p.add_argument("--max-k", type=int, default=DEFAULT_MAX_K, help=f"sweep k = 0..MAX_K (default {DEFAULT_MAX_K})")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN, help="speculate only if the step gains this much")


@dataclass
class Plan:
    """The step model's answer: median phase seconds, the autoregressive generation and step times,
    the speed-up bound (``ceiling`` as the generation speed-up grows without limit; ``bound_at_measured``
    at a measured one), and where acceptance and cost are known the k sweep and the recommended k."""

    phases: dict[str, float]
    t_gen_ar: float
    t_step_ar: float
    gen_fraction: float
    ceiling: float
    measured_k: int | None = None
    measured_gen_speedup: float | None = None
    bound_at_measured: float | None = None
    accept: list[float] | None = None
    cost: dict[str, float] | None = None
    batch: float = 1.0
    sweep: list[dict[str, float]] = field(default_factory=list)
    recommended_k: int | None = None
    accept_by_context: dict[str, list[float]] | None = None  # conditional acceptance per bucket
    context_mix: dict[str, float] | None = None  # share of generated tokens per bucket
    context_k: dict[str, int] | None = None  # one k per bucket (spec.adapt.by_context) ...
    context_row: dict[str, float] | None = None  # ... and the step it gives
    notes: list[str] = field(default_factory=list)
    source: str = "command line"


def _parse_accept(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        values = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise ValueError(f"--accept: expected numbers like 0.7 or 0.9,0.7,0.5, got {text!r}") from exc
    if not values or any(not 0 <= v <= 1 for v in values):
        raise ValueError(f"--accept: probabilities must lie in [0, 1], got {text!r}")
    return values


def _parse_buckets(text: str | None, option: str, probs: bool) -> dict | None:
    """``'lt4k=0.9,0.8;32k_64k=0.5'`` -> {bucket: [values]} (``probs``) or {bucket: value}."""
    if text is None:
        return None
    from areal_npu.speculation.context import BUCKET_LABELS

    out = {}
    for part in filter(None, text.replace(" ", "").split(";")):
        label, _, values = part.partition("=")
        if label not in BUCKET_LABELS:
            raise ValueError(
                f"{option}: unknown context bucket {label!r}; buckets: {', '.join(BUCKET_LABELS)}"
            )
        if probs:
            out[label] = _parse_accept(values)
        else:
            try:
                out[label] = float(values)
            except ValueError as exc:
                raise ValueError(f"{option}: expected bucket=share, got {part!r}") from exc
    return out or None


def _context_from_run(lines: list[dict]) -> tuple[dict | None, dict | None]:
    """Conditional acceptance per bucket and the token mix, from a run's ``rollout/spec_ctx_*``."""
    from areal_npu.speculation.context import pooled_by_bucket, token_mix
    from areal_npu.speculation.planner import conditional_from_unconditional

    pooled = pooled_by_bucket(lines)
    accept = {}
    for label, stats in pooled.items():
        u = []
        while f"accept_rate_pos{len(u)}" in stats:
            u.append(min(max(stats[f"accept_rate_pos{len(u)}"], 0.0), 1.0))
        if u:
            accept[label] = conditional_from_unconditional(u)
    return accept or None, token_mix(pooled) or None


def _per_pos(line: dict) -> list[float] | None:
    """``rollout/spec_accept_per_pos`` (list), else the scalars ``rollout/spec_accept_rate_pos<i>``."""
    if isinstance(line.get(names.SPEC_ACCEPT_PER_POS), list):
        return [float(u) for u in line[names.SPEC_ACCEPT_PER_POS]]
    out = []
    while names.spec_accept_rate_pos_key(len(out)) in line:
        out.append(float(line[names.spec_accept_rate_pos_key(len(out))]))
    return out or None


def _spec_k(line: dict) -> int | None:
    """``rollout/spec_k``, else ``rollout/spec_draft_tokens / rollout/spec_drafts`` (0 with no drafts)."""
    if names.SPEC_K in line:
        return int(line[names.SPEC_K])
    if names.SPEC_DRAFTS in line and names.SPEC_DRAFT_TOKENS in line:
        drafts = float(line[names.SPEC_DRAFTS])
        return round(float(line[names.SPEC_DRAFT_TOKENS]) / drafts) if drafts else 0
    return None


def _accepted_len(line: dict, k: int) -> float | None:
    if k == 0:
        return 1.0
    per_pos = _per_pos(line)
    if per_pos:
        return 1.0 + sum(per_pos[:k])
    if names.SPEC_MEAN_ACCEPTED_LEN in line:
        return float(line[names.SPEC_MEAN_ACCEPTED_LEN])
    if names.SPEC_ACCEPT_RATE in line:
        return 1.0 + float(line[names.SPEC_ACCEPT_RATE]) * k
    return None


def _finish(plan: Plan, accept, cost, args) -> Plan:
    from areal_npu.speculation.cost import recommend_k, sweep
    from areal_npu.speculation.planner import step_speedup

    if plan.measured_gen_speedup is not None:
        plan.bound_at_measured = step_speedup(plan.gen_fraction, plan.measured_gen_speedup)
    plan.accept = accept
    given = _parse_buckets(getattr(args, "accept_by_context", None), "--accept-by-context", probs=True)
    by_ctx = given or plan.accept_by_context
    mix = _parse_buckets(getattr(args, "context_mix", None), "--context-mix", probs=False) or plan.context_mix
    plan.accept_by_context, plan.context_mix = by_ctx, mix
    if cost is not None and by_ctx and mix:
        from areal_npu.speculation.cost import context_sweep

        swept = context_sweep(
            plan.t_gen_ar, plan.t_step_ar, by_ctx, mix, cost, plan.batch, range(args.max_k + 1), args.min_gain
        )
        plan.cost = cost.to_dict()
        plan.sweep = [asdict(r) for r in swept.rows]
        plan.recommended_k = recommend_k(swept.rows, args.min_gain)
        plan.context_k, plan.context_row = swept.k_by_bucket, asdict(swept.aware)
        plan.notes.append("acceptance per context bucket, weighted by the context mix (one k: "
                          "E[L] = 1 / Σ w_b / E_b[L]); the context-aware line is one k per bucket")  # fmt: skip
    elif cost is not None and accept is not None:
        rows = sweep(plan.t_gen_ar, plan.t_step_ar, accept, cost, plan.batch, range(args.max_k + 1))
        plan.cost = cost.to_dict()
        plan.sweep = [asdict(r) for r in rows]
        plan.recommended_k = recommend_k(rows, args.min_gain)
    elif plan.measured_gen_speedup is not None and plan.measured_k is not None:
        a = plan.measured_gen_speedup
        plan.sweep = [
            {"k": 0, "accepted_len": 1.0, "gen_speedup": 1.0, "t_gen": plan.t_gen_ar}
            | {"t_step": plan.t_step_ar, "step_speedup": 1.0},
            {"k": plan.measured_k, "accepted_len": None, "gen_speedup": a, "t_gen": plan.t_gen_ar / a}
            | {"t_step": plan.t_step_ar / plan.bound_at_measured, "step_speedup": plan.bound_at_measured},
        ]
        plan.recommended_k = plan.measured_k if plan.bound_at_measured >= 1 + args.min_gain else 0
        plan.notes.append("give --accept or --draft-cost for the k = 0..MAX_K sweep")
    else:
        plan.notes.append("no acceptance or draft cost: only the bound and its ceiling are known")
    return plan


def plan_from_numbers(args) -> Plan:
    """The plan from numbers given as :func:`add_step_arguments` declares them (``args`` parsed)."""
    from areal_npu.speculation.cost import draft_cost_from_speedup, relative_cost_model
    from areal_npu.speculation.planner import (
        expected_accepted_length,
        gen_fraction,
        step_speedup_ceiling,
        step_time,
    )

    phases = {p: getattr(args, f"t_{p}") for p in names.PHASES}
    phases = {p: float(v) for p, v in phases.items() if v is not None}
    if "gen" not in phases:
        raise ValueError("--t-gen: give the autoregressive generation seconds per step (or a run_dir)")
    t_step = args.t_step if args.t_step is not None else step_time(phases)
    if args.t_step is not None and step_time(phases) < t_step:
        phases["other"] = t_step - step_time(phases)
    r_gen = gen_fraction(phases["gen"], t_step)
    plan = Plan(phases, phases["gen"], t_step, r_gen, step_speedup_ceiling(r_gen))
    a = args.gen_speedup
    if a is None and args.t_gen_spec is not None:
        a = phases["gen"] / args.t_gen_spec
    if a is not None:
        if args.k is None:
            raise ValueError("--k: say at which draft length the generation speed-up was measured")
        plan.measured_k, plan.measured_gen_speedup = args.k, a
    accept = _parse_accept(args.accept)
    cost = None
    if args.draft_cost is not None:
        cost = relative_cost_model(args.draft_cost)
    elif accept is not None and a is not None:
        r = draft_cost_from_speedup(expected_accepted_length(accept, args.k), a, args.k)
        cost = relative_cost_model(r)
        plan.notes.append(
            f"draft cost {r:.3f} (autoregressive steps) calibrated from a={a:.3f} at k={args.k}"
        )
    return _finish(plan, accept, cost, args)


def plan_from_run(args) -> Plan:
    """The plan from ``args.run_dir``'s ``metrics.jsonl``, the step arguments refining it."""
    from areal_npu.metrics import read_metrics
    from areal_npu.speculation import planner as pl
    from areal_npu.speculation.cost import StepSample, calibrate, relative_cost_model

    lines = read_metrics(args.run_dir)
    notes: list[str] = []
    phases = {}
    for p in names.PHASES + names.SIDE_PHASES:  # every phase a run logs; side phases are only shown
        values = [float(x[names.timing_key(p)]) for x in lines if names.timing_key(p) in x]
        if values:
            phases[p] = statistics.median(values)
    if "gen" not in phases:
        raise ValueError(f"run_dir: no {names.timing_key('gen')} in metrics.jsonl")
    samples, spec_lines = [], []
    for x in lines:  # every step whose draft length and accepted length are known
        k = _spec_k(x)
        length = None if k is None else _accepted_len(x, k)
        if length is None:
            continue
        spec_lines.append((x, k, length))
        if all(key in x for key in (names.BATCH_SIZE, names.TOKENS_PER_S)):  # and its throughput
            samples.append(StepSample.from_throughput(x[names.BATCH_SIZE], k, length, x[names.TOKENS_PER_S]))
    accept = _parse_accept(args.accept)
    if accept is None:
        per_pos = [u for u in (_per_pos(x) for x, k, _ in spec_lines if k) if u]
        rates = [(x[names.SPEC_ACCEPT_RATE], k) for x, k, _ in spec_lines if k and names.SPEC_ACCEPT_RATE in x]
        if per_pos:
            depth = max(len(u) for u in per_pos)
            mean_u = [statistics.fmean(u[i] for u in per_pos if len(u) > i) for i in range(depth)]
            accept = pl.conditional_from_unconditional(mean_u)
        elif rates:
            k_mode = statistics.mode(k for _, k in rates)
            accept = [pl.iid_accept_from_rate(statistics.fmean(r for r, k in rates if k == k_mode), k_mode)]
    draft_cost = args.draft_cost
    one_k = len({s.k for s in samples}) < 2
    speculated = any(_spec_k(x) for x in lines)
    if draft_cost is None and (speculated and (not samples or one_k)):
        # the throughput cannot separate drafting from decoding: take the model's own ratio, say so
        draft_cost, why = default_draft_cost(args.run_dir)
        notes.append(f"draft cost {draft_cost:.3g} autoregressive steps per draft position ({why}); "
                     "--draft-cost overrides it")  # fmt: skip
    if samples:
        cost = calibrate(samples, draft_cost)
    elif draft_cost is not None:
        cost = relative_cost_model(draft_cost)
    else:
        cost = None
    batch = args.batch or (statistics.median(s.batch for s in samples) if samples else 1.0)
    # Rebase every step on autoregressive decoding: T_gen_ar = a(b, k)·T_gen of that step.
    gen_ar, other = [], []
    by_id = {id(x): (k, length) for x, k, length in spec_lines}
    for x in lines:
        if names.timing_key("gen") not in x:
            continue
        t_gen = float(x[names.timing_key("gen")])
        t_step = float(x.get(names.STEP_TIME, pl.step_time({p: x.get(names.timing_key(p), 0.0) for p in names.PHASES})))
        k, length = by_id.get(id(x), (_spec_k(x) or 0, 1.0))
        if k and cost is None:
            raise ValueError(
                "--draft-cost: the run speculated but its throughput cannot calibrate the cost model"
            )
        a = cost.gen_speedup(float(x.get(names.BATCH_SIZE, batch)), k, length) if k else 1.0
        gen_ar.append(a * t_gen)
        other.append(t_step - t_gen)
    t_gen_ar = statistics.median(gen_ar)
    t_step_ar = statistics.median(other) + t_gen_ar
    r_gen = pl.gen_fraction(t_gen_ar, t_step_ar)
    plan = Plan(phases, t_gen_ar, t_step_ar, r_gen, pl.step_speedup_ceiling(r_gen), batch=batch)
    plan.source = str(args.run_dir)
    plan.notes += notes
    if names.STEP_TIME in lines[0]:
        plan.phases["step"] = statistics.median(float(x[names.STEP_TIME]) for x in lines if names.STEP_TIME in x)
    plan.accept_by_context, plan.context_mix = _context_from_run(lines)
    ks = [k for _, k, _ in spec_lines if k]
    if ks and cost is not None:
        plan.measured_k = statistics.mode(ks)
        lengths = [length for _, k, length in spec_lines if k == plan.measured_k]
        plan.measured_gen_speedup = cost.gen_speedup(batch, plan.measured_k, statistics.fmean(lengths))
    return _finish(plan, accept, cost, args)


def default_draft_cost(run_dir) -> tuple[float, str]:
    """The relative draft cost when a run cannot calibrate one (no ``rollout/batch_size``, or one
    draft length): MTP layers / model layers, as ``scripts/bench_rollout.py`` models it, read from the
    run's ``config.yaml`` (``model.tiny``, else ``model.path``'s ``config.json``); else 0 (drafts taken
    as free, so every speed-up is an upper bound). Returns (cost, where it came from)."""
    import json
    from pathlib import Path

    import yaml

    root = Path(run_dir)
    root = root.parent if root.is_file() else root
    try:
        model = (yaml.safe_load((root / "config.yaml").read_text()) or {}).get("model") or {}
        hf = model.get("tiny") or {}
        if not hf and model.get("path"):
            hf = json.loads((Path(model["path"]) / "config.json").read_text())
            hf = hf.get("text_config", hf) if "num_hidden_layers" not in hf else hf
        layers = hf.get("num_hidden_layers")
        mtp = hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers")
        if layers and mtp:
            return mtp / layers, f"{mtp} MTP / {layers} model layers from the run's config"
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass  # no readable config: the free-draft bound below
    return 0.0, "the run's config names no MTP and model layer counts: drafts taken as free, an upper bound"


def render(plan: Plan) -> None:
    """The plan as tables on the terminal (``areal-npu plan``, and the dry run's step-time part)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = "as measured, median" if plan.source != "command line" else "autoregressive"
    phases = Table(title=f"Step phases ({title} seconds per step)")
    for col in ("phase", "seconds", "share"):
        phases.add_column(col, justify="left" if col == "phase" else "right")
    step = plan.phases.get("step", plan.t_step_ar)
    for name, seconds in plan.phases.items():
        if name != "step":  # side phases overlap the step or follow it (areal_npu.names)
            label = f"{name} (not in step)" if name in names.SIDE_PHASES else name
            phases.add_row(label, f"{seconds:.2f}", f"{seconds / step:.1%}")
    phases.add_row("step", f"{step:.2f}", "100.0%")
    console.print(phases)
    console.print(
        f"autoregressive: T_gen {plan.t_gen_ar:.2f} s of T_step {plan.t_step_ar:.2f} s, "
        f"R_gen = {plan.gen_fraction:.3f}; ceiling (a → ∞) {plan.ceiling:.2f}×"
    )
    if plan.bound_at_measured is not None:
        console.print(
            f"measured generation speed-up {plan.measured_gen_speedup:.3f}× at k={plan.measured_k} "
            f"→ step speed-up bound S ≤ 1/(R_gen/a + 1 − R_gen) = {plan.bound_at_measured:.3f}×"
        )
    if plan.sweep:
        table = Table(title="Predicted speed-up over autoregressive decoding")
        for col in ("k", "accepted len", "rollout ×", "T_gen s", "T_step s", "step ×", ""):
            table.add_column(col, justify="right")
        for row in plan.sweep:
            length = "—" if row["accepted_len"] is None else f"{row['accepted_len']:.2f}"
            mark = "◀ recommended" if row["k"] == plan.recommended_k else ""
            table.add_row(
                str(row["k"]), length, f"{row['gen_speedup']:.3f}", f"{row['t_gen']:.2f}",
                f"{row['t_step']:.2f}", f"{row['step_speedup']:.3f}", mark,
            )  # fmt: skip
        console.print(table)
    if plan.recommended_k is not None:
        console.print(
            f"recommended k = {plan.recommended_k}" + (" (speculation off)" if not plan.recommended_k else "")
        )
    if plan.context_k is not None:
        per = ", ".join(f"{b}: {k}" for b, k in plan.context_k.items())
        console.print(
            f"context-aware k ({per}): rollout {plan.context_row['gen_speedup']:.3f}×, "
            f"step {plan.context_row['step_speedup']:.3f}× (rollout.spec.adapt.by_context)"
        )
    for note in plan.notes:
        console.print(f"note: {note}")

