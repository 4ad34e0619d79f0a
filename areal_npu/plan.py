"""``areal-npu plan``: phase breakdown, step speed-up bound and a draft-length recommendation, or
with ``--memory RECIPE`` the trainer's peak memory per device for a recipe.

The step model and its inputs are :mod:`areal_npu.speculation.step_plan` (a run directory's
``metrics.jsonl``, or numbers on the command line); the memory estimate is
:func:`areal_npu.step_estimate.recipe_memory_report`. This module is the command around them: its
arguments, the table or JSON it prints, the PNG it draws.

Only the standard library and :mod:`~areal_npu.speculation.step_plan` (argparse, :mod:`areal_npu.names`)
are imported at module level: ``areal-npu --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from areal_npu.speculation import step_plan
from areal_npu.speculation.step_plan import Plan

EXIT_INPUT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", help="run directory with metrics.jsonl (or the file itself)")
    step_plan.add_step_arguments(p)
    p.add_argument("--plot", metavar="PATH", help="write a PNG: phases and speed-up against k")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--memory",
        metavar="RECIPE",
        help="instead of the step model: the trainer's peak memory per device for a recipe YAML "
        "(areal_npu.memory_model at its layout and tokens per micro-batch, against the device's memory)",
    )
    p.add_argument(
        "--model-config",
        metavar="CONFIG_JSON",
        help="with --memory: the model's config.json (model.path's when omitted)",
    )


def write_plot(plan: Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    best = next((r for r in plan.sweep if r["k"] == plan.recommended_k), None)
    bars = [("autoregressive", plan.t_gen_ar)] + ([(f"k={best['k']}", best["t_gen"])] if best else [])
    rest = plan.t_step_ar - plan.t_gen_ar
    for y, (_, t_gen) in enumerate(bars):
        left.barh(y, t_gen, color="tab:orange", label="generation" if y == 0 else None)
        left.barh(y, rest, left=t_gen, color="tab:gray", label="other phases" if y == 0 else None)
    left.set_yticks(range(len(bars)), [b[0] for b in bars])
    left.set_xlabel("seconds per step")
    left.legend()
    if plan.sweep and all(r["accepted_len"] is not None for r in plan.sweep):
        ks = [r["k"] for r in plan.sweep]
        right.plot(ks, [r["gen_speedup"] for r in plan.sweep], "o-", label="rollout speed-up")
        right.plot(ks, [r["step_speedup"] for r in plan.sweep], "s-", label="step speed-up")
    if plan.ceiling != float("inf"):
        right.axhline(plan.ceiling, ls="--", color="k", lw=0.8, label="step ceiling 1/(1−R_gen)")
    right.axhline(1.0, color="gray", lw=0.5)
    right.set_xlabel("draft length k")
    right.set_ylabel("× over autoregressive")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _check_memory_flags(args: argparse.Namespace) -> None:
    """``--memory`` reads a recipe, not step times: the step model's inputs are refused with it."""
    if not args.memory:
        if args.model_config:
            raise ValueError("--model-config: describes the model for --memory; add --memory RECIPE")
        return
    defaults = {"max_k": step_plan.DEFAULT_MAX_K, "min_gain": step_plan.DEFAULT_MIN_GAIN}
    given = [name for name, value in vars(args).items()
             if name not in ("memory", "model_config", "json", "func", "command")
             and value not in (None, False, defaults.get(name))]  # fmt: skip
    if given:
        flag = "run_dir" if given[0] == "run_dir" else "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag}: the step model's input; --memory RECIPE estimates memory only")


def _run_memory(args: argparse.Namespace) -> int:
    from areal_npu import step_estimate

    estimates = step_estimate.recipe_memory_report(args.memory, args.model_config)
    if args.json:
        print(json.dumps(estimates.to_dict(), indent=2))
    else:
        step_estimate.render(estimates)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        _check_memory_flags(args)
        if args.memory:
            return _run_memory(args)
        plan = step_plan.plan_from_run(args) if args.run_dir else step_plan.plan_from_numbers(args)
    except ValueError as exc:
        print(f"areal-npu plan: {exc}", file=sys.stderr)
        return EXIT_INPUT
    if args.plot:
        write_plot(plan, args.plot)
    if args.json:
        out = asdict(plan)
        out["ceiling"] = None if plan.ceiling == float("inf") else plan.ceiling
        print(json.dumps(out, indent=2))
    else:
        step_plan.render(plan)
    return 0
