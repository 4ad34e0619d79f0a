#!/usr/bin/env python
"""The Megatron engine's gradient reduction: reduce-scatter (what it does, as Megatron's
DistributedOptimizer does) against all-reduce (what it did), side by side over the same ranks.

Each of ``--ranks`` gloo ranks (fresh interpreters) holds one flat fp32 gradient buffer of ``--mib``
MiB (the engine's per-group buffer, :mod:`areal_npu.train.megatron.precision`) and alternates the two
collectives ``--repeats`` times, timing each (a barrier before every one). A ring all-reduce sends
2 (w - 1) / w of the buffer per rank, a reduce-scatter (w - 1) / w: the expected ratio is ~2 where the
transport dominates. Medians per rank, and their ratio.

    .venv/bin/python scripts/bench_grad_reduce.py [--quick] [--mib 256] [--ranks 2] [--repeats 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 1 << 20


def _rank(rank: int, world: int, init: str, out: str, numel: int, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        buffer = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        mine = torch.empty(numel // world)
        times: dict[str, list[float]] = {"all_reduce": [], "reduce_scatter": []}
        for _ in range(repeats):
            for name in times:
                work = buffer.clone()
                dist.barrier()
                start = time.perf_counter()
                if name == "all_reduce":
                    dist.all_reduce(work)
                    summed = work
                else:
                    dist.reduce_scatter_tensor(mine, work)
                times[name].append(time.perf_counter() - start)
        # the two agree on this rank's slice (the same sum, perhaps in another order: fp32 rounding)
        torch.testing.assert_close(mine, summed.view(world, -1)[rank])
        Path(f"{out}.{rank}.json").write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB, 3 repeats")
    parser.add_argument("--mib", type=int, default=256, help="the buffer per rank (fp32)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    mib, repeats = (32, 3) if args.quick else (args.mib, args.repeats)
    numel = mib * MiB // 4 // args.ranks * args.ranks
    with tempfile.TemporaryDirectory(prefix="bench_grad_reduce_") as tmp:
        out = str(Path(tmp) / "times")
        mp.start_processes(
            _rank, args=(args.ranks, str(Path(tmp) / "rdv"), out, numel, repeats),
            nprocs=args.ranks, join=True, start_method="spawn",
        )  # fmt: skip
        per_rank = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(args.ranks)]
    print(f"fp32 buffer {mib} MiB per rank, {args.ranks} gloo ranks, {repeats} repeats (median seconds)")
    print(f"{'rank':>5}{'all_reduce s':>15}{'reduce_scatter s':>19}{'ratio':>8}")
    rows = []
    for rank, times in enumerate(per_rank):
        ar, rs = statistics.median(times["all_reduce"]), statistics.median(times["reduce_scatter"])
        rows.append({"rank": rank, "all_reduce_s": ar, "reduce_scatter_s": rs, "ratio": ar / rs})
        print(f"{rank:>5}{ar:>15.3f}{rs:>19.3f}{ar / rs:>8.2f}")
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                   "torch": torch.__version__}  # fmt: skip
        args.json.write_text(json.dumps({"machine": machine, "mib": mib, "ranks": args.ranks, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
