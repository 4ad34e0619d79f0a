#!/usr/bin/env python
"""Peak memory and time of chunked vs naive token log-probs (forward + backward).

Each (method, T, V) case runs in a fresh subprocess so cases cannot share allocator state.

What "peak" means here:
  * CUDA: ``torch.cuda.max_memory_allocated()`` during forward+backward minus the bytes allocated
    just before it (inputs already on the device). Caching-allocator slack is not counted.
  * CPU: the process's resident-set high-water mark (Linux ``VmHWM``) over forward+backward minus
    the resident set just before it. The high-water mark is reset right before the run through
    ``/proc/self/clear_refs`` (value 5), so it covers only the measured run. This is memory the OS
    really handed out: it includes allocator overhead and the gradient buffers (d hidden [T, H],
    d weight [V, H]) that any implementation needs; it is an upper bound on live tensor bytes.

The chunked kernel's peak should not grow with T beyond the T·H-sized tensors (hidden gradient),
while the naive one grows with T·V (several [T, V] float32 buffers).

Methods:
  * ``naive``: full float32 logits (inputs upcast), log_softmax, gather — the exact reference;
  * ``naive-bf16``: what most RL code does with a bf16 model: ``(h @ W.T).float()`` (a bf16 GEMM whose
    logits are rounded to bf16), then the same — the speed to match;
  * ``chunked``: :func:`chunked_logprobs_entropy` with eager per-chunk pointwise work;
  * ``chunked-fused``: the same with the pointwise work compiled (``fused=True``; CUDA's default).

Usage:  python scripts/bench_logprobs.py [--quick] [--json PATH] [--device cpu|cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MB = 1024 * 1024


METHODS = ("naive", "naive-bf16", "chunked", "chunked-fused")


def _naive_rounded(hidden, weight, targets):
    """Common practice: logits from the model's dtype GEMM, then float32 (rounded logits)."""
    import torch

    logprobs = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked, -(logprobs.exp() * logprobs).sum(-1)


def run_case(
    method: str,
    T: int,
    V: int,
    H: int,
    chunk: int,
    device: str,
    reps: int,
    threads: int,
    dtype: str = "float32",
) -> dict:
    """Runs inside the child process."""
    import torch
    from areal_npu.kernels.logprobs import chunked_logprobs_entropy, naive_logprobs_entropy

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    hidden = torch.randn(T, H, device=dev, dtype=dt).requires_grad_()
    weight = (torch.randn(V, H, device=dev) / H**0.5).to(dt).requires_grad_()
    targets = torch.randint(0, V, (T,), device=dev)

    def step():
        if method == "naive":
            lp, ent = naive_logprobs_entropy(hidden, weight, targets)
        elif method == "naive-bf16":
            lp, ent = _naive_rounded(hidden, weight, targets)
        else:
            fused = method == "chunked-fused"
            lp, ent = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=chunk, fused=fused)
        (lp.sum() + 0.01 * ent.sum()).backward()
        hidden.grad = None
        weight.grad = None

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if method == "chunked-fused":
        step()  # compile outside the measurement (once per process; a training run pays it once)
    # measured run: first call, so nothing is cached from an earlier one
    if dev.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
        how = "cuda.max_memory_allocated"
    else:
        from areal_npu.testing.memory import reset_peak_rss, status_bytes

        base = status_bytes("VmRSS")
        if reset_peak_rss():
            step()
            peak = status_bytes("VmHWM") - base
            how = "VmHWM (reset) - VmRSS"
        else:
            import resource

            step()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            how = "ru_maxrss - VmRSS (upper bound)"
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {
        "method": method,
        "T": T,
        "V": V,
        "H": H,
        "chunk_size": chunk if method.startswith("chunked") else None,
        "device": device,
        "dtype": dtype,
        "peak_mb": peak / MB,
        "peak_measure": how,
        "time_ms": 1000 * statistics.median(times),
        "logits_fp32_mb": T * V * 4 / MB,
        "reps": reps,
    }


def spawn_case(method, T, V, H, chunk, device, reps, threads, timeout, dtype) -> dict:
    case = [method, T, V, H, chunk, device, reps, threads, dtype]
    cmd = [sys.executable, __file__, "--_case", json.dumps(case)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"method": method, "T": T, "V": V, "H": H, "error": f"timeout after {timeout}s"}
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["?"]
        return {"method": method, "T": T, "V": V, "H": H, "error": f"rc={out.returncode}: {tail[0]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grid (CI-sized)")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=256, help="hidden size H")
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--seq-lens", default=None, help="comma-separated T values (overrides the grid)")
    ap.add_argument("--vocabs", default=None, help="comma-separated V values (overrides the grid)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per case")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--naive-max-gb",
        type=float,
        default=8.0,
        help="skip naive cases whose 6 [T, V] fp32 buffers exceed this",
    )
    ap.add_argument("--timeout", type=int, default=600, help="seconds per case")
    ap.add_argument("--_case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._case:
        print(json.dumps(run_case(*json.loads(args._case))))
        return 0

    if args.quick:
        seq_lens, vocabs, reps = [512, 2048, 4096], [8192, 32768], args.reps or 1
    else:
        seq_lens, vocabs, reps = [1024, 2048, 4096, 8192], [8192, 32768, 65536], args.reps or 2
    seq_lens = [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else seq_lens
    vocabs = [int(x) for x in args.vocabs.split(",")] if args.vocabs else vocabs
    default_methods = ("naive", "chunked") if args.device == "cpu" else METHODS
    methods = args.methods.split(",") if args.methods else default_methods
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    results = []
    for V in vocabs:
        for T in seq_lens:
            for method in methods:
                if method.startswith("naive") and 6 * T * V * 4 > args.naive_max_gb * 1024**3:
                    results.append(
                        {"method": method, "T": T, "V": V, "H": args.hidden, "error": "skipped (memory)"}
                    )
                    continue
                r = spawn_case(
                    method, T, V, args.hidden, args.chunk_size, args.device, reps, args.threads, args.timeout,
                    args.dtype,
                )  # fmt: skip
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)

    _print_table(results, args)
    if args.json:
        meta = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads,
            "device": args.device,
            "hidden": args.hidden,
            "chunk_size": args.chunk_size,
            "dtype": args.dtype,
            "methods": list(methods),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


def _print_table(results: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    by_key = {(r["method"], r["T"], r["V"]): r for r in results}
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    table = Table(
        title=f"log-probs fwd+bwd, H={args.hidden}, {args.dtype}, chunk={args.chunk_size}, device={args.device}, "
        f"threads={args.threads}"
    )
    table.add_column("T", justify="right")
    table.add_column("V", justify="right")
    table.add_column("[T,V] fp32 MB", justify="right")
    for m in methods:
        table.add_column(f"{m} peak MB", justify="right")
    for m in methods:
        table.add_column(f"{m} ms", justify="right")
    ratio = [m for m in ("chunked", "chunked-fused") if m in methods] if "naive-bf16" in methods else []
    for m in ratio:
        table.add_column(f"{m} / naive-bf16", justify="right")

    def cell(r: dict | None, key: str) -> str:
        if r is None:
            return "-"
        if "error" in r:
            return r["error"]
        return f"{r[key]:.0f}" if key == "peak_mb" else f"{r[key]:.1f}"

    for T, V in sorted({(r["T"], r["V"]) for r in results}, key=lambda k: (k[1], k[0])):
        row = [str(T), str(V), f"{T * V * 4 / MB:.0f}"]
        row += [cell(by_key.get((m, T, V)), "peak_mb") for m in methods]
        row += [cell(by_key.get((m, T, V)), "time_ms") for m in methods]
        base = by_key.get(("naive-bf16", T, V))
        for m in ratio:
            r = by_key.get((m, T, V))
            ok = base and r and "time_ms" in base and "time_ms" in r
            row.append(f"{r['time_ms'] / base['time_ms']:.2f}x" if ok else "-")
        table.add_row(*row)
    console = Console(width=220)
    console.print(table)
    hows = {r.get("peak_measure") for r in results if "peak_measure" in r}
    console.print(f"peak = {', '.join(sorted(hows))} over one forward+backward, fresh process per case")


if __name__ == "__main__":
    sys.exit(main())
