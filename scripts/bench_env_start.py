"""Environment start latency with and without the warm pool, and grading time, on a real task set.

    python scripts/bench_env_start.py --dataset TASKS.jsonl [--image-root DIR] [--backend bwrap]
        [--tasks N] [--group G] [--quick] [--json PATH]

For each of N tasks a group of G episodes runs as the shell agent runs them: the group's copies are
asked for when it starts, then each episode resets its environment, runs one command (the task's test
command, the longest thing an agent typically runs) and is graded (empty patch). "cold": RepoEnv
without a pool (each reset materializes the base tree and copies it); "warm": the shell agent's
WarmPool (base once per task, copies prefetched while earlier episodes run). Prints p50/p95 of the
start latency and of grading time per mode, and their ratios; --json writes the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from areal_npu.agent import env_backends, tasksets
from areal_npu.agent.environments import RepoEnv, make_base
from areal_npu.agent.warm_pool import WarmPool


def run_group(task, group: int, backend, pool: WarmPool | None) -> tuple[list[float], list[float]]:
    if pool is not None:
        pool.prefetch(task, group)

    def episode(_):
        with RepoEnv(task, backend=backend, pool=pool) as env:
            env.run(task.hidden_tests.command if hasattr(task.hidden_tests, "command") else "ls")
            grade = env.grade()
            return env.start_seconds, float(grade.details.get("grade_seconds", 0.0))

    with ThreadPoolExecutor(group) as ex:
        results = list(ex.map(episode, range(group)))
    return [r[0] for r in results], [r[1] for r in results]


def measure(tasks, group: int, backend, warm: bool) -> dict:
    pool = WarmPool(lambda t, d: make_base(t, d, backend), workers=group) if warm else None
    starts, grades = [], []
    wall = time.monotonic()
    try:
        for task in tasks:
            s, g = run_group(task, group, backend, pool)
            starts += s
            grades += g
    finally:
        if pool is not None:
            pool.close()
    wall = time.monotonic() - wall
    pct = lambda v, q: float(np.percentile(v, q))  # noqa: E731
    return {"episodes": len(starts), "start_p50_s": pct(starts, 50), "start_p95_s": pct(starts, 95),
            "grade_p50_s": pct(grades, 50), "grade_p95_s": pct(grades, 95),
            "episodes_per_min": 60 * len(starts) / wall}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="a task set (areal_npu.agent.tasksets.load)")
    p.add_argument("--image-root", help="folder of the rows' images")
    p.add_argument("--backend", default="bwrap")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="2 tasks")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    tasks = tasksets.load(args.dataset, image_root=args.image_root)[: 2 if args.quick else args.tasks]
    backend = env_backends.resolve(env_backends.EnvConfig(backend=args.backend), key="--backend")
    rows = {mode: measure(tasks, args.group, backend, mode == "warm") for mode in ("cold", "warm")}
    cols = ("episodes", "start_p50_s", "start_p95_s", "grade_p50_s", "grade_p95_s", "episodes_per_min")
    print(f"{'mode':<6}" + "".join(f"{c:>17}" for c in cols))
    for mode, r in rows.items():
        print(f"{mode:<6}" + "".join(f"{r[c]:>17.3f}" if isinstance(r[c], float) else f"{r[c]:>17}" for c in cols))
    ratio = {"start_p50_cold_over_warm": rows["cold"]["start_p50_s"] / max(rows["warm"]["start_p50_s"], 1e-9),
             "start_p95_cold_over_warm": rows["cold"]["start_p95_s"] / max(rows["warm"]["start_p95_s"], 1e-9)}  # fmt: skip
    print(" | ".join(f"{k} {v:.1f}x" for k, v in ratio.items()) + f" | backend {backend.name}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"backend": backend.name, "tasks": len(tasks), "group": args.group, **rows, **ratio}, fh,
                      indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
