"""Peak host memory of one trainer rank writing a checkpoint (``tests/train/megatron/test_save_memory.py``,
``tests/train/test_fsdp2_save_memory.py``): the Megatron (TP = world) or FSDP2 (sharded over world)
engine is built from a generated checkpoint (:func:`areal_npu.testing.load_memory.write_checkpoint`),
AdamW's moments are filled in (as after a step), then ``save_checkpoint`` runs (after a warm-up save and
the heap's free pages handed back) with the peak reset to the resident size just before. Tensors of
1 MiB or more are mapped apart and unmapped when freed (:func:`.memory.map_large_allocations`), so
the peak counts the memory in use, not what glibc keeps of a small model's freed tensors.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

__all__ = ["measure_save"]


def _megatron(model_dir: str, world: int):
    """(engine, fp32 state bytes on this rank, param bytes on this rank)."""
    from areal_npu.train.config import MegatronLayoutConfig, TrainEngineConfig
    from areal_npu.train.megatron.engine import MegatronEngine

    cfg = TrainEngineConfig(backend="megatron", megatron=MegatronLayoutConfig(tp_size=world))
    engine = MegatronEngine.from_checkpoint(model_dir, cfg)
    opt = engine.optimizer
    for g in opt.groups:  # the moments a step leaves (their values do not change the bytes)
        state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(g.master),
                 "exp_avg_sq": torch.zeros_like(g.master)}  # fmt: skip
        opt.optimizer.state[g.master] = state
    return engine, opt.state_bytes(), sum(p.nbytes for p in engine.module.parameters())


def _fsdp2(model_dir: str):
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine

    engine = FSDPEngine.from_checkpoint(model_dir, TrainEngineConfig(), MTPConfig(enabled=False))
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            engine.optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                         "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    params = sum(p.to_local().nbytes for p in engine.module.parameters())
    return engine, 3 * params, params


def measure_save(
    rank: int, world: int, model_dir: str, init_file: str, out: str, root: str, engine_kind: str = "megatron"
) -> None:
    """Writes ``{out}.{rank}.json``: resident bytes before, peak, the engine's fp32 state (params or
    masters + moments) and params on this rank, seconds. ``engine_kind``: megatron | fsdp2."""
    from areal_npu.testing.memory import (
        map_large_allocations,
        release_free_heap,
        reset_peak_rss,
        status_bytes,
    )
    from areal_npu.train.dist import process_group

    map_large_allocations()  # freed tensors leave the resident set, as a large model's do
    with process_group(rank, world, f"file://{init_file}"):
        engine, state, params = _fsdp2(model_dir) if engine_kind == "fsdp2" else _megatron(model_dir, world)
        engine.save_checkpoint(Path(root) / "warm")  # imports and first-call allocations are not the save
        torch.distributed.barrier()
        release_free_heap()  # the warm save's freed heap would hide what the save re-uses of it
        reset_peak_rss()
        before, start = status_bytes("VmRSS"), time.perf_counter()
        engine.save_checkpoint(Path(root) / "ckpt")
        seconds = time.perf_counter() - start
        result = {"rank": rank, "engine": engine_kind, "rss_before": before, "peak": status_bytes("VmHWM"),
                  "state": state, "params": params, "seconds": seconds}  # fmt: skip
        Path(f"{out}.{rank}.json").write_text(json.dumps(result))
        torch.distributed.barrier()
