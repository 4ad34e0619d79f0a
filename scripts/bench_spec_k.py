"""Best fixed k vs today's adaptive k vs context-aware k on multi-turn episodes whose context grows
(a simulation over measured acceptance-by-context curves; no engine).

Workload: ``--slots`` episodes decode together (one GRPO group per training step, all starting
together); each runs ``--turns`` turns of ``--response`` (±50%) generated tokens, the context growing
by the response plus ``--observation`` tool tokens per turn from a ``--prompt``-token start, so one
step sweeps the context from a few K to ~60K. Engine: every scheduler step drafts k tokens for the
whole batch (vLLM's one k per step; the context-aware k is the batch's dominant bucket's,
:func:`areal_npu.speculation.k_driver.batch_k`), each sequence accepts a prefix of its drafts with
its context bucket's conditional acceptance, and the step costs ``1 + r·k`` autoregressive steps
(``--draft-cost`` r; :mod:`areal_npu.speculation.cost`) with 3% noise on the throughput a controller sees.

Acceptance by bucket: the tiny model's measured curve (``scripts/bench_spec_context.py``'s JSON via
``--curve``, else its ``--policy-len 0`` run's, docs/bench/spec_context_joint_cpu.json), its bins mapped onto the buckets 64x
longer (a head trained on 64 tokens evaluated at 64-4096 stands for one trained at <4K evaluated at
up to 256K): position 1 accepts with ``alpha_1``, position 2 with ``u_1 / alpha_1``, deeper positions
repeat position 2's. Controllers see what a run logs: per step ``rollout/spec_accept_rate_pos<i>`` and
``rollout/tokens_per_busy_s`` (today's :class:`~areal_npu.speculation.policy.AdaptiveSpec`) or the
per-bucket ``rollout/spec_ctx_*`` (:class:`~areal_npu.speculation.context_k.ContextAwareK`).

    python scripts/bench_spec_k.py [--quick] [--json PATH] [--curve bench_spec_context.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rich.console import Console
from rich.table import Table

from areal_npu import names
from areal_npu.speculation.acceptance import SpecCounters, spec_stats
from areal_npu.speculation.context import BUCKET_LABELS, CONTEXT_EDGES, BucketCounts, bucket_stats
from areal_npu.speculation.context_k import ContextAwareK
from areal_npu.speculation.k_driver import batch_k
from areal_npu.speculation.policy import AdaptiveSpec, SpecAdaptConfig

#: bench_spec_context.py --policy-len 0 (bench/spec_context_joint_cpu.json): bins [0,64) [64,256) [256,1024) [1024,4096)
MEASURED = {"alpha1": [0.939, 0.564, 0.491, 0.500], "u1": [0.894, 0.309, 0.219, 0.231]}
BIN_OF_BUCKET = [0, 1, 2, 2, 3]  # lt4k, 4k_16k, 16k_32k, 32k_64k, ge64k <- the tiny bins x64
K_MAX = 4


def conditional_by_bucket(curve: dict) -> np.ndarray:
    """[bucket, position] conditional acceptance (see the module docstring)."""
    rows = []
    for b in range(len(BUCKET_LABELS)):
        a1, u1 = curve["alpha1"][BIN_OF_BUCKET[b]], curve["u1"][BIN_OF_BUCKET[b]]
        p2 = u1 / a1 if a1 else 0.0
        rows.append([a1] + [p2] * (K_MAX - 1))
    return np.array(rows)


def simulate(policy: str, cond: np.ndarray, args, seed: int = 0) -> dict:
    """One run of ``args.steps`` training steps under ``policy`` (``k=<n>``, ``adaptive``, ``context``)."""
    rng = np.random.default_rng(seed)
    cfg = dict(k_max=K_MAX, k_init=2)
    adaptive = AdaptiveSpec(SpecAdaptConfig(**cfg)) if policy == "adaptive" else None
    by_ctx = (
        ContextAwareK(SpecAdaptConfig(**cfg, by_context=True, draft_cost=args.draft_cost))
        if policy == "context"
        else None
    )
    fixed = int(policy[2:]) if policy.startswith("k=") else None
    table = list(by_ctx.k) if by_ctx else None
    total_time = total_tokens = 0.0
    ks = []
    for _step in range(args.steps):
        k_now = fixed if fixed is not None else (adaptive.k if adaptive else None)
        ctx = np.full(args.slots, float(args.prompt))
        turns_left = np.full(args.slots, args.turns)
        left = rng.integers(args.response // 2, args.response * 3 // 2 + 1, args.slots).astype(float)
        hist = np.zeros((len(BUCKET_LABELS), K_MAX + 1, K_MAX + 1), dtype=np.int64)  # [bucket, k, accepted]
        drafts = accepted = draft_tokens = 0
        acc_pos = [0] * K_MAX
        step_time = tokens = 0.0
        while (active := turns_left > 0).any():
            live = np.flatnonzero(active)
            buckets = np.searchsorted(CONTEXT_EDGES, ctx[live], side="right")  # = context_bucket
            k = k_now if table is None else batch_k(ctx[live].tolist(), table, table[0])
            if k:
                draws = rng.random((len(live), k)) < cond[buckets][:, :k]
                acc = np.where(draws.all(1), k, draws.argmin(1))  # accepted prefix length
                np.add.at(hist, (buckets, k, acc), 1)
                drafts += len(live)
                draft_tokens += k * len(live)
                accepted += int(acc.sum())
                for i in range(k):
                    acc_pos[i] += int((acc > i).sum())
            else:
                acc = np.zeros(len(live), dtype=int)
            made = np.minimum(acc + 1, left[live])
            step_time += 1.0 + args.draft_cost * k
            tokens += float(made.sum())
            ctx[live] += made
            left[live] -= made
            done = live[left[live] <= 0]
            ctx[done] += args.observation
            turns_left[done] -= 1
            left[done] = rng.integers(args.response // 2, args.response * 3 // 2 + 1, len(done))
            ks.append(k)
        total_time += step_time
        total_tokens += tokens
        seen_tps = tokens / step_time * (1 + 0.03 * rng.standard_normal())
        if adaptive is not None:
            stats = spec_stats(SpecCounters(drafts=drafts, draft_tokens=draft_tokens, accepted=accepted,
                                            accepted_per_pos=acc_pos[:k_now] if k_now else []))  # fmt: skip
            adaptive.observe(
                k_now, [stats.get(names.spec_accept_rate_pos_key(i), 0.0) for i in range(k_now)], seen_tps
            )
        if by_ctx is not None:
            counts = {b: BucketCounts() for b in range(len(BUCKET_LABELS))}
            for b, kk in zip(*np.nonzero(hist.sum(-1)), strict=True):
                counts[b].add_histogram(hist[b, kk].tolist(), int(kk * hist[b, kk].sum()), int(kk))
            table = by_ctx.observe(bucket_stats(counts))
    return {"policy": policy, "time": total_time, "tokens": total_tokens, "tokens_per_step_time": total_tokens / total_time,
            "mean_k": float(np.mean(ks)), "final_table": table, "final_k": adaptive.k if adaptive else fixed}  # fmt: skip


def run(args, curve: dict) -> list[dict]:
    cond = conditional_by_bucket(curve)
    rows = []
    for r in args.draft_costs:
        args.draft_cost = r
        results = [simulate(p, cond, args, seed) for seed in range(args.seeds)
                   for p in [f"k={k}" for k in range(K_MAX + 1)] + ["adaptive", "context"]]  # fmt: skip
        by_policy: dict[str, list[dict]] = {}
        for res in results:
            by_policy.setdefault(res["policy"], []).append(res)
        speed = {p: float(np.median([x["tokens_per_step_time"] for x in v])) for p, v in by_policy.items()}
        best_fixed = max((p for p in speed if p.startswith("k=")), key=speed.get)
        for p, v in by_policy.items():
            rows.append({"draft_cost": r, "policy": p, "speedup_vs_k0": speed[p] / speed["k=0"],
                         "vs_best_fixed": speed[p] / speed[best_fixed], "best_fixed": best_fixed,
                         "mean_k": float(np.median([x["mean_k"] for x in v])), "final_table": v[0]["final_table"],
                         "final_k": v[0]["final_k"]})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and seeds (CI smoke)")
    parser.add_argument("--curve", help="bench_spec_context.py --json output (default: the recorded numbers)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (one group of episodes each)")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--slots", type=int, default=16, help="episodes decoding together")
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the first turn's prompt")
    parser.add_argument("--response", type=int, default=256, help="mean generated tokens per turn")
    parser.add_argument("--observation", type=int, default=6000, help="tool-output tokens added per turn")
    parser.add_argument("--draft-costs", type=float, nargs="+", default=[0.05, 0.15, 0.3, 0.5],
                        help="one draft position in autoregressive steps (r)")  # fmt: skip
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    args.steps = args.steps or (12 if args.quick else 40)
    args.seeds = args.seeds or (1 if args.quick else 2)
    curve = MEASURED
    if args.curve:
        rows = json.load(open(args.curve))["rows"]
        curve = {"alpha1": [r["alpha1"] for r in rows], "u1": [r["u1"] for r in rows]}
    rows = run(args, curve)
    table = Table(title=f"Generation speed by draft-length policy ({args.steps} steps x {args.slots} episodes x "
                  f"{args.turns} turns, median of {args.seeds} seeds; simulated)")  # fmt: skip
    for col in ("r", "policy", "x k=0", "x best fixed", "mean k", "k at the end"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        end = r["final_table"] if r["final_table"] is not None else r["final_k"]
        table.add_row(f"{r['draft_cost']:.2f}", r["policy"], f"{r['speedup_vs_k0']:.3f}",
                      f"{r['vs_best_fixed']:.3f} ({r['best_fixed']})", f"{r['mean_k']:.2f}", str(end))  # fmt: skip
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "curve": curve, "rows": rows},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
