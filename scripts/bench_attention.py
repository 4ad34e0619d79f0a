#!/usr/bin/env python
"""Packed (THD) causal attention, forward + backward: the dispatching kernel against the ways around it.

Methods, all on the same packed q/k/v (GQA: 16 query / 4 KV heads unless told otherwise):
  * ``packed``: :func:`areal_npu.kernels.packed_attention.packed_attention` as training calls it
    (CUDA bf16: flash-attn if installed, else torch's ``varlen_attn`` over strided head groups;
    CPU: the exact per-segment path);
  * ``varlen-repeat-kv`` (CUDA): one ``varlen_attn`` call with the KV heads repeated — the simple
    alternative to head groups, for comparison;
  * ``per-segment``: one SDPA call per segment (the old CUDA fallback; the CPU path);
  * ``padded``: sequences padded to the longest and one batched causal SDPA call.

Layouts: ``short`` (many short segments, lengths drawn from a fixed seed) and ``long`` (8 equal
segments). Times are medians of ``--reps`` runs after one warm-up; peak is the allocator's peak
above the inputs (CUDA) — the CPU's numbers are for relative comparison only.

Usage:  python scripts/bench_attention.py [--quick] [--json PATH] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from areal_npu.kernels import packed_attention as pa

METHODS = ("packed", "varlen-repeat-kv", "per-segment", "padded")


def segment_lengths(layout: str, total: int) -> list[int]:
    if layout == "long":
        return [total // 8] * 8
    g = torch.Generator().manual_seed(0)
    lengths, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(64, 1500, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return lengths


def _padded(q, k, v, cu):
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    longest = max(lengths)

    def pad(x):
        return torch.stack(
            [F.pad(x[a:b], (0, 0, 0, 0, 0, longest - (b - a))) for a, b in zip(bounds, bounds[1:])]
        )

    qp, kp, vp = (pad(x).transpose(1, 2) for x in (q, k, v))  # [S, H, L, d]
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True).transpose(1, 2)
    return torch.cat([out[i, :n] for i, n in enumerate(lengths)])


def _varlen_repeat_kv(q, k, v, cu):
    from torch.nn.attention.varlen import varlen_attn

    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    longest = int((cu[1:] - cu[:-1]).max())
    return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))


def run_method(method, q, k, v, cu, reps):
    fn = {
        "packed": lambda *x: pa.packed_attention(*x),
        "varlen-repeat-kv": _varlen_repeat_kv,
        "per-segment": pa.packed_attention_reference,
        "padded": _padded,
    }[method]
    cuda = q.device.type == "cuda"
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    grad = torch.randn_like(q)

    def step():
        out = fn(*xs, cu)
        out.backward(grad)
        for x in xs:
            x.grad = None
        return out

    def sync():
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"time_ms": 1000 * statistics.median(times), "peak_mb": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    ap.add_argument("--tokens", type=int, default=None, help="packed tokens per micro-batch")
    ap.add_argument("--heads", default="16,4", help="query,kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)

    cuda = args.device == "cuda"
    tokens = args.tokens or (4096 if args.quick else 65536 if cuda else 16384)
    reps = args.reps or (1 if args.quick else 5)
    hq, hkv = (int(x) for x in args.heads.split(","))
    dtype = torch.bfloat16 if cuda else torch.float32
    methods = [m for m in METHODS if cuda or m != "varlen-repeat-kv"]
    results = []
    for layout in ("short", "long"):
        lengths = segment_lengths(layout, tokens)
        g = torch.Generator(device=args.device).manual_seed(0)
        q, k, v = (
            torch.randn(tokens, h, args.head_dim, generator=g, device=args.device, dtype=dtype)
            for h in (hq, hkv, hkv)
        )
        cu = torch.tensor(
            [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=args.device
        )
        ref = pa.packed_attention_reference(q.float(), k.float(), v.float(), cu)
        for method in methods:
            try:
                r = run_method(method, q, k, v, cu, reps)
                with torch.no_grad():
                    out = {"packed": pa.packed_attention, "per-segment": pa.packed_attention_reference}.get(
                        method, _padded if method == "padded" else _varlen_repeat_kv
                    )(q, k, v, cu)
                r["max_abs_err_vs_fp32"] = float((out.float() - ref).abs().max())
            except (RuntimeError, torch.OutOfMemoryError) as e:
                r = {"error": str(e).splitlines()[0][:80]}
            r.update(layout=layout, method=method, segments=len(lengths), tokens=tokens)
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
        del q, k, v, ref

    _print_table(results, args, hq, hkv, dtype)
    if args.json:
        meta = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": str(dtype),
            "heads": [hq, hkv],
            "head_dim": args.head_dim,
            "reps": reps,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


def _print_table(results, args, hq, hkv, dtype) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"packed attention fwd+bwd, {hq}/{hkv} heads, d={args.head_dim}, {dtype}, {args.device}"
    )
    for col in ("layout", "segments", "tokens", "method", "ms", "vs packed", "peak MB", "max |err| vs fp32"):
        table.add_column(col, justify="right")
    packed = {r["layout"]: r.get("time_ms") for r in results if r["method"] == "packed"}
    for r in results:
        t = r.get("time_ms")
        base = packed.get(r["layout"])
        table.add_row(
            r["layout"], str(r["segments"]), str(r["tokens"]), r["method"],
            f"{t:.1f}" if t else r.get("error", "-"),
            f"{t / base:.2f}x" if t and base else "-",
            f"{r['peak_mb']:.0f}" if r.get("peak_mb") is not None else "-",
            f"{r['max_abs_err_vs_fp32']:.1e}" if "max_abs_err_vs_fp32" in r else "-",
        )  # fmt: skip
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
