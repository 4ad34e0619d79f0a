"""``areal-npu tasks validate PATH``: is a task set valid in its environments, before a cluster is
spent on it?

PATH is a SWE-bench-format JSONL file, one swebench 5 task directory, a task repository, or a folder
of JSONL files (:func:`areal_npu.agent.tasksets.load`). Every instance is checked by
:func:`areal_npu.agent.validate.check_task` (empty patch -> 0, gold patch -> 1, tampered tests -> 0)
on the chosen environment backend; the command prints a table, the pass rates and the latencies,
writes JSON with ``--json``, and exits 1 when any instance is invalid (2 on bad input or when the
backend cannot start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict

from areal_npu.agent.env_backends import NAMES

EXIT_INVALID, EXIT_INPUT = 1, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tasks_command", required=True, metavar="SUBCOMMAND")
    v = sub.add_parser("validate", help="empty patch -> 0, gold patch -> 1, tampered tests -> 0, per instance")
    v.add_argument("path", help="SWE-bench JSONL, a swebench 5 task directory or task repository, or a folder")
    v.add_argument("--backend", default="auto", choices=NAMES, help="environment backend (default auto: the "
                   "first isolated one that starts)")  # fmt: skip
    v.add_argument("--fallback", default="", choices=("", *NAMES[1:]),
                   help="the weaker backend allowed when the chosen cannot start")
    v.add_argument("--image-root", metavar="DIR", help="folder that relative image paths are under")
    v.add_argument("--snapshots", metavar="DIR", help="folder of repository snapshots (default: PATH's folder)")
    v.add_argument("--limit", type=int, default=0, help="check only the first N instances")
    v.add_argument("--workers", type=int, default=2, help="instances checked at the same time (default 2)")
    v.add_argument("--timeout", type=float, default=300.0, help="wall seconds of one grading (default 300)")
    v.add_argument("--json", metavar="PATH", help="write the rows and the summary as JSON")
    p.set_defaults(func=run)


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def summary(checks) -> dict:
    n = len(checks)
    starts = [c.start_s for c in checks if not c.error]
    grades = [g for c in checks for g in c.grade_s]
    return {
        "instances": n,
        "valid": sum(c.valid for c in checks),
        "gold_pass_rate": sum(c.gold == 1.0 for c in checks) / n,
        "empty_pass_rate": sum(c.empty == 1.0 for c in checks) / n,
        "tamper_pass_rate": sum(c.tamper == 1.0 for c in checks) / n,
        "start_p50_s": _pct(starts, 50), "start_p95_s": _pct(starts, 95),
        "grade_p50_s": _pct(grades, 50), "grade_p95_s": _pct(grades, 95),
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from areal_npu.agent import env_backends, tasksets
    from areal_npu.agent.environments import EnvLimits
    from areal_npu.agent.jail import JailLimits
    from areal_npu.agent.validate import check_task
    from areal_npu.agent.warm_pool import WarmPool
    from areal_npu.config import ConfigError

    console = Console(stderr=True)
    try:
        tasks = tasksets.load(args.path, args.snapshots, args.image_root)
    except (ValueError, OSError) as exc:
        console.print(f"[red]tasks: {exc}")
        return EXIT_INPUT
    if args.limit > 0:
        tasks = tasks[: args.limit]
    try:
        backend = env_backends.resolve(env_backends.EnvConfig(backend=args.backend, fallback=args.fallback),
                                       key="tasks", fallback_key="--fallback", backend_key="--backend")  # fmt: skip
    except ConfigError as exc:
        console.print(f"[red]{exc}")
        return EXIT_INPUT
    t = args.timeout
    limits = EnvLimits(grading=JailLimits(wall_seconds=t, cpu_seconds=t, output_bytes=4 << 20))
    from areal_npu.agent.environments import area_sizes, make_base

    pool = WarmPool(lambda task, dest: make_base(task, dest, backend), workers=max(1, args.workers),
                    area=area_sizes(limits.command))  # fmt: skip
    checks = [None] * len(tasks)
    start = time.monotonic()
    try:
        with Progress(console=console, transient=True) as progress, ThreadPoolExecutor(args.workers) as ex:
            bar = progress.add_task(f"validating on {backend.name}", total=len(tasks))
            futures = {ex.submit(check_task, task, backend, limits, pool): i for i, task in enumerate(tasks)}
            for fut in as_completed(futures):
                checks[futures[fut]] = fut.result()
                progress.advance(bar)
    finally:
        pool.close()
    wall = time.monotonic() - start
    table = Table(title=f"{args.path}: {len(tasks)} instances on {backend.name} ({wall:.0f} s)")
    for col in ("instance", "start s", "empty", "gold", "tamper", "grade s", "valid", "note"):
        table.add_column(col)
    show = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    for c in checks:
        note = c.error or ", ".join(f"{k}: {v}" for k, v in c.reasons.items() if not c.valid)
        table.add_row(c.task_id, f"{c.start_s:.2f}", show(c.empty), show(c.gold), show(c.tamper),
                      " ".join(f"{g:.1f}" for g in c.grade_s), "yes" if c.valid else "[red]NO", note[:80])  # fmt: skip
    Console().print(table)
    s = summary(checks)
    print(f"valid {s['valid']}/{s['instances']} | gold pass {s['gold_pass_rate']:.0%} | empty pass "
          f"{s['empty_pass_rate']:.0%} | tamper pass {s['tamper_pass_rate']:.0%} | env start p50 "
          f"{s['start_p50_s']:.2f} s p95 {s['start_p95_s']:.2f} s | grading p50 {s['grade_p50_s']:.2f} s "
          f"p95 {s['grade_p95_s']:.2f} s | backend {backend.name}")  # fmt: skip
    if args.json:
        payload = {"backend": backend.name, "wall_s": wall, "summary": s,
                   "rows": [{**asdict(c), "valid": c.valid} for c in checks]}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
    return 0 if s["valid"] == s["instances"] else EXIT_INVALID


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="areal-npu tasks")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
