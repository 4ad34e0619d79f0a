#!/usr/bin/env python
"""Packed (THD) causal attention, forward + backward: both CUDA paths per layout and the dispatcher's pick.

Methods, all on the same packed q/k/v (GQA: 16 query / 4 KV heads unless told otherwise):
  * ``packed``: :func:`areal_npu.kernels.packed_attention.packed_attention` as training calls it
    (CUDA bf16: the path :func:`areal_npu.kernels.attention_dispatch.cuda_attention_path` picks
    for the layout; CPU: the exact per-segment path);
  * ``varlen`` (CUDA): the varlen path alone (flash-attn if installed, else torch's ``varlen_attn``,
    over strided head groups when it has no native GQA);
  * ``varlen-repeat-kv`` (CUDA): one ``varlen_attn`` call with the KV heads repeated;
  * ``per-segment``: one SDPA call per segment (the other CUDA path; the CPU path);
  * ``padded``: sequences padded to the longest and one batched causal SDPA call.

Layouts: ``short`` (many short segments, lengths drawn from a fixed seed), ``medium`` (segments
of T/16), ``long`` (8 equal segments) and ``mixed`` (one half-T segment, the rest short). Each
layout's summary row gives the dispatcher's choice, its predicted ms per path (the H200 model) and,
where both paths ran, the measured faster one. Times are medians of ``--reps`` runs after one
warm-up; peak is the allocator's peak above the inputs (CUDA) — the CPU's numbers are for relative
comparison only (the varlen kernels are CUDA-only).

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
from areal_npu.kernels import attention_dispatch as dispatch
from areal_npu.kernels import packed_attention as pa

METHODS = ("packed", "varlen", "varlen-repeat-kv", "per-segment", "padded")
LAYOUTS = ("short", "medium", "long", "mixed")
CUDA_ONLY = ("varlen", "varlen-repeat-kv")


def _short(total: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(64, 1500, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return lengths


def segment_lengths(layout: str, total: int) -> list[int]:
    if layout == "long":
        return [total // 8] * 8
    if layout == "medium":
        return [total // 16] * 16
    if layout == "mixed":
        return [total // 2, *_short(total - total // 2)]
    return _short(total)


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


def _varlen(q, k, v, cu):
    return pa.cuda_varlen_attention(q, k, v, cu, q.shape[-1] ** -0.5)


def _method_fn(method):
    return {
        "packed": pa.packed_attention,
        "varlen": _varlen,
        "varlen-repeat-kv": _varlen_repeat_kv,
        "per-segment": pa.packed_attention_reference,
        "padded": _padded,
    }[method]


def run_method(method, q, k, v, cu, reps):
    fn = _method_fn(method)
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
    methods = [m for m in METHODS if cuda or m not in CUDA_ONLY]
    results, choices = [], []
    for layout in LAYOUTS:
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
        measured = {}
        for method in methods:
            try:
                r = run_method(method, q, k, v, cu, reps)
                with torch.no_grad():
                    out = _method_fn(method)(q, k, v, cu)
                r["max_abs_err_vs_fp32"] = float((out.float() - ref).abs().max())
                measured[method] = r["time_ms"]
            except (RuntimeError, torch.OutOfMemoryError) as e:
                r = {"error": str(e).splitlines()[0][:80]}
            r.update(layout=layout, method=method, segments=len(lengths), tokens=tokens)
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
        choices.append(_choice(layout, lengths, hq, hkv, args.head_dim, measured))
        del q, k, v, ref

    _print_table(results, args, hq, hkv, dtype)
    _print_choices(choices)
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
            json.dump({"meta": meta, "results": results, "dispatch": choices}, f, indent=2)
    return 0


def _choice(layout, lengths, hq, hkv, head_dim, measured) -> dict:
    """The dispatcher's CUDA pick for a layout, its predictions and, if both ran, the faster path."""
    path = pa.cuda_path_for(lengths, hq, hkv, head_dim)
    predicted = dispatch.predicted_cuda_ms(lengths, hq, hkv, head_dim, pa.cuda_native_gqa())
    both = {dispatch.VARLEN: measured.get("varlen"), dispatch.PER_SEGMENT: measured.get("per-segment")}
    faster = min(both, key=both.get) if None not in both.values() else None
    return {
        "layout": layout,
        "segments": len(lengths),
        "tokens": sum(lengths),
        "longest": max(lengths),
        "choice": path,
        "predicted_ms": {k: round(x, 2) for k, x in predicted.items()},
        "measured_faster": faster,
        "choice_is_faster": None if faster is None else faster == path,
    }


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


def _print_choices(choices) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="CUDA dispatch by layout (predicted ms: the H200 model in attention_dispatch)")
    for col in (
        "layout",
        "segments",
        "longest",
        "choice",
        "pred. varlen",
        "pred. per-seg",
        "measured faster",
    ):
        table.add_column(col, justify="right")
    for c in choices:
        table.add_row(
            c["layout"], str(c["segments"]), str(c["longest"]), c["choice"],
            f"{c['predicted_ms'][dispatch.VARLEN]:.1f}", f"{c['predicted_ms'][dispatch.PER_SEGMENT]:.1f}",
            c["measured_faster"] or "- (varlen needs CUDA)",
        )  # fmt: skip
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
