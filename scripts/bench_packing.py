#!/usr/bin/env python
"""Packing benchmark: slot utilization, micro-batch counts, planning time, CPU train throughput.

Two length distributions:
- agent: long-tailed code-agent trajectories, log-normal (median 8K) clipped to [1K, 64K], cap 64K;
- math: short responses, log-normal (median 600) clipped to [64, 4K], cap 16K.

Layouts compared under the same token cap:
- padded: fixed rows per micro-batch (HF-style), arrival order, as many micro-batches as FFD uses,
  each padded to its longest row; slots = sum over micro-batches of rows * max_len;
- padded-capped: arrival order, a micro-batch takes the next sequence while rows * max_len <= cap
  (token-budgeted dynamic padded batching, a stronger baseline);
- ffd / kk: THD packing (areal_npu.data.packing); slots = real tokens + alignment padding.

Throughput: a tiny Qwen3 (hidden 128, 2 layers) on CPU, forward + backward of every micro-batch of
one step, real tokens / s (best of the repeats). Lengths and cap are scaled down (agent / 64:
16..1024 tokens, cap 1024; math / 8: 8..512 tokens, cap 2048) because a CPU cannot run 64K-token
micro-batches in a benchmark. --threads sets torch's intra-op threads (default 1: steadier on a
shared machine).

    .venv/bin/python scripts/bench_packing.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from areal_npu.data.packed_layout import pack_sequences
from areal_npu.data.packing import (
    PackingConfig,
    ffd_pack,
    kk_partition,
    lower_bound_micro_batches,
    plan_micro_batches,
)

DISTRIBUTIONS = {
    # name: (median, sigma, lo, hi, cap)
    "agent": (8192, 1.0, 1024, 65536, 65536),
    "math": (600, 0.7, 64, 4096, 16384),
}
# Length divisor for the CPU throughput run: agent 16..1024 tokens (cap 1024), math 8..512 (cap 2048).
CPU_SCALE = {"agent": 64, "math": 8}


def sample_lengths(name: str, n: int, seed: int = 0) -> list[int]:
    median, sigma, lo, hi, _ = DISTRIBUTIONS[name]
    rng = random.Random(seed)
    return [min(hi, max(lo, int(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


def padded_plan(lengths: list[int], cap: int) -> list[list[int]]:
    """Dynamic padded batching in arrival order: rows * max_len <= cap."""
    plan, cur, cur_max = [], [], 0
    for i, s in enumerate(lengths):
        new_max = max(cur_max, s)
        if cur and (len(cur) + 1) * new_max > cap:
            plan.append(cur)
            cur, new_max = [], s
        cur.append(i)
        cur_max = new_max
    if cur:
        plan.append(cur)
    return plan


def fixed_rows_plan(lengths: list[int], count: int) -> list[list[int]]:
    """Fixed-size padded micro-batches: ceil(n / count) rows each, arrival order."""
    rows = -(-len(lengths) // count)
    return [list(range(i, min(i + rows, len(lengths)))) for i in range(0, len(lengths), rows)]


def layout_row(name: str, lengths: list[int], cap: int, layout: str, alignment: int = 1) -> dict:
    real = sum(lengths)
    t0 = time.perf_counter()
    if layout.startswith("padded"):
        if layout == "padded":
            plan = fixed_rows_plan(lengths, len(ffd_pack(lengths, cap)))
        else:
            plan = padded_plan(lengths, cap)
        per_mb = [len(mb) * max(lengths[i] for i in mb) for mb in plan]
    else:
        plan = plan_micro_batches(lengths, PackingConfig(max_tokens_per_mb=cap, mode=layout))
        per_mb = [-(-sum(lengths[i] for i in mb) // alignment) * alignment for mb in plan]
    slots = sum(per_mb)
    plan_s = time.perf_counter() - t0
    lb = lower_bound_micro_batches(lengths, cap)
    return {
        "distribution": name,
        "layout": layout,
        "sequences": len(lengths),
        "real_tokens": real,
        "slots": slots,
        "utilization": real / slots,
        "cap_fill": real / (len(plan) * cap),
        "peak_mb_slots_over_cap": max(per_mb) / cap,
        "micro_batches": len(plan),
        "lower_bound": lb,
        "over_bound": len(plan) - lb,
        "plan_seconds": plan_s,
    }


def planning_time(name: str, n: int) -> dict:
    lengths = sample_lengths(name, n, seed=1)
    cap = DISTRIBUTIONS[name][4]
    t0, c0 = time.perf_counter(), time.process_time()
    bins = ffd_pack(lengths, cap)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "distribution": name,
        "sequences": n,
        "ffd_seconds": dt,
        "ffd_cpu_seconds": cpu,  # CPU time of this process: less sensitive to a shared, loaded machine
        "micro_batches": len(bins),
        "lower_bound": lower_bound_micro_batches(lengths, cap),
    }


def kk_time(name: str, n: int) -> dict:
    lengths = sample_lengths(name, n, seed=2)
    k = lower_bound_micro_batches(lengths, DISTRIBUTIONS[name][4])
    t0 = time.perf_counter()
    kk_partition(lengths, k)
    return {"distribution": name, "sequences": n, "k": k, "kk_seconds": time.perf_counter() - t0}


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def throughput(name: str, n: int, scale: int, repeats: int) -> dict:
    from areal_npu.model.packed import enable_packed_attention, packed_forward_kwargs

    _, _, lo, hi, cap = DISTRIBUTIONS[name]
    cap //= scale
    lengths = [max(2, s // scale) for s in sample_lengths(name, n, seed=3)]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1024, (s,), generator=g) for s in lengths]
    real = sum(lengths)
    result = {"distribution": name, "sequences": n, "scale": scale, "cap": cap, "real_tokens": real}

    model = tiny_model()
    plan = plan_micro_batches(lengths, PackingConfig(max_tokens_per_mb=cap))
    padded_plans = {"padded": fixed_rows_plan(lengths, len(plan)), "padded-capped": padded_plan(lengths, cap)}

    def padded_step(padded):
        for mb in padded:
            width = max(lengths[i] for i in mb)
            ids = torch.zeros(len(mb), width, dtype=torch.long)
            mask = torch.zeros(len(mb), width, dtype=torch.long)
            for r, i in enumerate(mb):
                ids[r, : lengths[i]] = seqs[i]
                mask[r, : lengths[i]] = 1
            labels = ids.masked_fill(mask == 0, -100)
            model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()

    packed_model = enable_packed_attention(tiny_model())
    batches = [pack_sequences([seqs[i] for i in mb], sample_indices=mb) for mb in plan]

    def packed_step():
        for b in batches:
            kw = packed_forward_kwargs(b)
            packed_model(**kw, labels=kw["input_ids"]).loss.backward()

    runs = [(k, lambda p=p: padded_step(p), len(p)) for k, p in padded_plans.items()]
    for key, fn, count in runs + [("packed", packed_step, len(plan))]:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = min(times)
        result[f"{key}_seconds"] = best
        result[f"{key}_tokens_per_s"] = real / best
        result[f"{key}_micro_batches"] = count
    result["speedup"] = result["packed_tokens_per_s"] / result["padded_tokens_per_s"]
    result["speedup_vs_capped"] = result["packed_tokens_per_s"] / result["padded-capped_tokens_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()

    n_traj = 128 if args.quick else 512
    n_plan = 20_000 if args.quick else 100_000
    repeats = 1 if args.quick else 3
    torch.set_num_threads(args.threads)

    layouts = []
    for name in DISTRIBUTIONS:
        lengths = sample_lengths(name, n_traj)
        cap = DISTRIBUTIONS[name][4]
        for layout in ("padded", "padded-capped", "ffd", "kk"):
            layouts.append(layout_row(name, lengths, cap, layout))
    plans = [planning_time(name, n_plan) for name in DISTRIBUTIONS]
    kks = [kk_time(name, n_traj) for name in DISTRIBUTIONS]
    thr = [
        throughput(name, n_traj // (2 if name == "agent" else 1), CPU_SCALE[name], repeats)
        for name in DISTRIBUTIONS
    ]

    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"Slot utilization, {n_traj} sequences per step")
    for col in ("dist", "layout", "real tok", "slots", "util", "peak/cap", "mbs", "lower bd", "plan ms"):
        t.add_column(col, justify="right")
    for r in layouts:
        t.add_row(r["distribution"], r["layout"], f"{r['real_tokens']:,}", f"{r['slots']:,}", f"{r['utilization']:.1%}",
                  f"{r['peak_mb_slots_over_cap']:.2f}", str(r["micro_batches"]), str(r["lower_bound"]), f"{1e3 * r['plan_seconds']:.1f}")  # fmt: skip
    console.print(t)
    t = Table(title="Planning time (FFD)")
    for col in ("dist", "sequences", "wall s", "cpu s", "mbs", "lower bd"):
        t.add_column(col, justify="right")
    for r in plans:
        t.add_row(
            r["distribution"],
            f"{r['sequences']:,}",
            f"{r['ffd_seconds']:.3f}",
            f"{r['ffd_cpu_seconds']:.3f}",
            str(r["micro_batches"]),
            str(r["lower_bound"]),
        )
    for r in kks:
        t.add_row(
            f"{r['distribution']} (KK, k={r['k']})",
            f"{r['sequences']:,}",
            f"{r['kk_seconds']:.3f}",
            "",
            "",
            "",
        )
    console.print(t)
    t = Table(title="CPU train throughput, tiny Qwen3, fwd+bwd, lengths scaled (agent / 64, math / 8)")
    for col in (
        "dist",
        "seqs",
        "cap",
        "padded tok/s",
        "capped tok/s",
        "packed tok/s",
        "vs padded",
        "vs capped",
        "mbs pad/cap/pack",
    ):
        t.add_column(col, justify="right")
    for r in thr:
        t.add_row(r["distribution"], str(r["sequences"]), str(r["cap"]), f"{r['padded_tokens_per_s']:,.0f}",
                  f"{r['padded-capped_tokens_per_s']:,.0f}", f"{r['packed_tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x",
                  f"{r['speedup_vs_capped']:.2f}x",
                  f"{r['padded_micro_batches']}/{r['padded-capped_micro_batches']}/{r['packed_micro_batches']}")  # fmt: skip
    console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"quick": args.quick, "layouts": layouts, "planning": plans, "kk": kks, "throughput": thr},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
