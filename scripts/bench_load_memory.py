#!/usr/bin/env python
"""Peak host memory per rank while an engine loads an HF checkpoint or saves a checkpoint (issue 29).

A dense Qwen3 checkpoint of random fp32 weights (hidden 1024, FFN 2816, 8 query / 4 KV heads of
128, vocabulary 8192; 30 layers: ~1.5 GB, ``--quick``: 4 layers, ~250 MB) is written as 64 MiB
safetensors shards with ``model.safetensors.index.json``. Two gloo ranks (TP=2), each a fresh
interpreter (``spawn``), build the Megatron model and load their shards:

- ``stream``: the engine's path (:mod:`areal_npu.train.megatron.stream`): this rank's rows / columns
  read into the uninitialised parameters;
- ``full``: the path before: transformers loads the whole model (fp32), the rank keeps its shards;
- ``fsdp2-stream`` / ``fsdp2-full``: the FSDP2 engine over the same 2 ranks, built on the meta
  device and each rank reading its rows (``FSDPEngine.from_checkpoint``), or from the whole model;
- ``megatron-save`` / ``fsdp2-save``: the engine (loaded as above), AdamW's moments filled in, then
  ``save_checkpoint`` (:mod:`areal_npu.testing.save_memory`); "held" is then the rank's fp32 state.

Per rank: resident memory before, peak growth while building + loading (or saving; ``VmHWM`` reset
just before), what the rank holds afterwards, and the growth as a fraction of the checkpoint.

    .venv/bin/python scripts/bench_load_memory.py [--quick] [--modes stream,full,fsdp2-stream,fsdp2-full] [--json PATH]
    .venv/bin/python scripts/bench_load_memory.py --quick --modes megatron-save,fsdp2-save
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

from areal_npu.testing.load_memory import dense_config, measure_rank, write_checkpoint
from areal_npu.testing.save_memory import measure_save

MiB = 1 << 20


def run(model_dir: Path, mode: str, work: Path) -> list[dict]:
    out, rdv = str(work / f"{mode}"), str(work / f"{mode}.rdv")
    if mode.endswith("-save"):
        fn, args = (
            measure_save,
            (2, str(model_dir), rdv, out, str(work / f"{mode}.ckpt"), mode[: -len("-save")]),
        )
    else:
        fn, args = measure_rank, (2, str(model_dir), rdv, out, mode, False)
    mp.start_processes(fn, args=args, nprocs=2, join=True, start_method="spawn")
    rows = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(2)]
    return [{"held": r["state"], **r} if "state" in r else r for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers (~250 MB) instead of 30 (~1.5 GB)")
    parser.add_argument("--modes", default="stream,full,fsdp2-stream,fsdp2-full")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    layers = 4 if args.quick else 30
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        work = Path(tmp)
        size = write_checkpoint(work / "ckpt", dense_config(layers=layers), shard_bytes=64 * MiB)
        shards = len(list((work / "ckpt").glob("*.safetensors")))
        print(
            f"checkpoint: {size / MiB:.0f} MiB fp32 in {shards} shards, {layers} layers; TP=2, 2 ranks (gloo)"
        )
        print(f"{'mode':<14}{'rank':>5}{'rss before MiB':>16}{'peak growth MiB':>17}{'held MiB':>10}"
              f"{'growth/ckpt':>13}{'seconds':>9}")  # fmt: skip
        for mode in args.modes.split(","):
            for r in run(work / "ckpt", mode, work):
                growth = r["peak"] - r["rss_before"]
                row = {
                    **r,
                    "growth": growth,
                    "checkpoint_bytes": size,
                    "ratio": growth / size,
                    "layers": layers,
                }
                rows.append(row)
                print(f"{mode:<14}{r['rank']:>5}{r['rss_before'] / MiB:>16.0f}{growth / MiB:>17.0f}"
                      f"{r['held'] / MiB:>10.0f}{growth / size:>13.3f}{r['seconds']:>9.2f}")  # fmt: skip
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
