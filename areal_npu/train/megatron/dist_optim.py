"""The Megatron engine's fp32 masters and AdamW moments as one sharded checkpoint that any TP x DP
layout can read back (torch.distributed.checkpoint, the format of Megatron-Core's ``torch_dist``).

Each rank writes only the slices it owns (:class:`.precision.MasterOptimizer`: a contiguous range
of its TP shard's flat buffer); no rank gathers the masters. Every parameter is stored as one global
2-D tensor in a layout that does not depend on TP (``key``: the Megatron name with the *global*
layer index, ``mtp.`` before the MTP head's): its TP-independent rows (HF order: ``[gate; up]``,
a Gated DeltaNet projection's full rows) with the TP shard dim mapped onto rows (dim 0) or columns
(row-parallel weights); a 1-D tensor is one column. A rank's flat range of a parameter becomes at
most a partial row, a band of full rows and a partial row per TP section, each a chunk at its global
offset; a resume asks for its own ranges the same way and DCP reads the overlapping chunks
(resharding). Replicated weights are written and read by TP rank 0 only, then broadcast over TP.
One DCP checkpoint a state (``master/``, ``exp_avg/``, ``exp_avg_sq/``): DCP's writer copies every
chunk it writes (a view of the flat buffer) and keeps the copies until the save ends, so a save's
extra host memory is one state's slices, not all three.

Why not ``megatron.core.dist_checkpointing.save`` itself (0.16.1, tried on the CPU over gloo): its
``torch_dist`` writer calls ``torch.cuda.synchronize()`` while preloading tensors (fails without
CUDA) and starts a ``multiprocessing.Manager``; the on-disk format is the same DCP one.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from areal_npu.names import MTP_PREFIX
from areal_npu.train.megatron import convert
from areal_npu.train.megatron.pipeline import from_last_stage

__all__ = ["MOMENTS", "load_optimizer_state", "save_optimizer_state"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def _kinds(engine, index: int) -> dict[str, tuple[str, str]]:
    """Local Megatron name -> (checkpoint key, rule kind) of parameter group ``index``."""
    if index == 1:
        from areal_npu.train.megatron.mtp import MTP_RULES

        return {r.mcore: (MTP_PREFIX + r.mcore, r.kind) for r in MTP_RULES}
    start = engine.stage.layers(engine.shape.num_layers).start
    out = {}
    for rule in convert.rules(engine.shape, engine.stage):
        key = convert._LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + start}.", rule.mcore)
        out[rule.mcore] = (key, rule.kind)
    return out


def _placement(kind: str, local: torch.Size, tp_rank: int, tp: int, shape):
    """(global 2-D shape, column offset, [(local row, global row, rows)], replicated) of one parameter."""
    rows, cols = local[0], prod(local[1:])
    if kind in convert.REPLICATED:
        return (rows, cols), 0, [(0, 0, rows)], True
    if kind in ("row", "gdn:out_proj.weight"):
        return (rows, cols * tp), tp_rank * cols, [(0, 0, rows)], False
    if kind == "gate_up":
        half = rows // 2
        return (rows * tp, cols), 0, [(0, tp_rank * half, half), (half, (tp + tp_rank) * half, half)], False
    if kind.startswith("gdn:"):
        from areal_npu.train.megatron.gdn import _slices

        cfg, name = convert._gdn_config(shape), kind[len("gdn:") :]
        total = max(s.stop for r in range(tp) for s in _slices(cfg, r, tp)[name])
        sections, at = [], 0
        for s in _slices(cfg, tp_rank, tp)[name]:
            sections.append((at, s.start, s.stop - s.start))
            at += s.stop - s.start
        return (total, cols), 0, sections, False
    return (rows * tp, cols), 0, [(0, tp_rank * rows, rows)], False


def _chunks(a: int, b: int, cols: int, col_off: int, sections):
    """(start in [a, b), rows, cols, global offset) covering a parameter's local flat range [a, b)."""
    for local_row, global_row, n in sections:
        x, y = max(a, local_row * cols), min(b, (local_row + n) * cols)
        while x < y:
            r, c = divmod(x, cols)
            if c or y - x < cols:
                width = min(cols - c, y - x)
                yield x - a, 1, width, (global_row + r - local_row, col_off + c)
                x += width
            else:
                band = (y - x) // cols
                yield x - a, band, cols, (global_row + r - local_row, col_off)
                x += band * cols


def _layout(engine):
    """Per parameter of every group: (group index, key, global shape, replicated, (start in this
    rank's master slice, length owned), [(start in the slice, rows, cols, global offset)])."""
    opt, tp = engine.optimizer, engine.config.megatron.tp_size
    out = []
    for index, g in enumerate(opt.groups):
        kinds = _kinds(engine, index)
        offset = 0
        for name, p in zip(g.names, g.params):
            key, kind = kinds[name]
            gshape, col_off, sections, replicated = _placement(
                kind, p.shape, engine.tp_rank, tp, engine.shape
            )
            a, b = max(g.start - offset, 0), min(g.start + g.shard - offset, p.numel())
            chunks = []
            if a < b and not (replicated and engine.tp_rank != 0):
                cols = prod(p.shape[1:])  # the local rows' length (row-parallel: global = cols x tp)
                chunks = [
                    (offset + a - g.start + s, r, c, o)
                    for s, r, c, o in _chunks(a, b, cols, col_off, sections)
                ]
            out.append((index, key, gshape, replicated, (offset + a - g.start, max(b - a, 0)), chunks))
            offset += p.numel()
    return out


def _state_dict(engine, layout, buffers) -> dict[str, ShardedTensor]:
    """DCP ShardedTensors over views of ``buffers[index][state]`` (every rank's chunks gathered once)."""
    mine = {f"{key}/{state}": [(list(o), [r, c]) for _, r, c, o in chunks]
            for index, key, _, _, _, chunks in layout for state in buffers[index]}  # fmt: skip
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    device = engine.optimizer.groups[0].master.device
    props = TensorProperties(torch.float32, torch.strided, False, torch.contiguous_format, False)
    out = {}
    for index, key, gshape, _, _, chunks in layout:
        for state, buffer in buffers[index].items():
            if not chunks:
                continue
            name = f"{key}/{state}"
            metas = [
                ShardMetadata(o, s, f"rank:{r}/{device}")
                for r, m in enumerate(every)
                for o, s in m.get(name, [])
            ]
            local = [
                Shard(
                    buffer[s : s + r * c].view(r, c),
                    ShardMetadata(list(o), [r, c], f"rank:{dist.get_rank()}/{device}"),
                )
                for s, r, c, o in chunks
            ]
            meta = ShardedTensorMetadata(metas, torch.Size(gshape), props)
            out[name] = ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)
    return out


def save_optimizer_state(engine, directory: Path) -> dict:
    """Write this rank's masters and moments under ``directory`` (collective); returns what
    ``optim.pt`` records (steps, hyper-parameters) for :func:`load_optimizer_state`."""
    opt = engine.optimizer
    buffers = []
    for g in opt.groups:
        state = opt.optimizer.state.get(g.master, {})
        buffers.append({"master": g.master.detach(), **{k: state[k] for k in MOMENTS if k in state}})
    layout = _layout(engine)
    for state in ("master", *MOMENTS):  # one DCP save a state: DCP copies what one save writes
        if any(state in b for b in buffers):
            only = [{k: v for k, v in b.items() if k == state} for b in buffers]
            dcp.save(_state_dict(engine, layout, only), checkpoint_id=str(directory / state))
    steps = [float(opt.optimizer.state[g.master]["step"]) if g.master in opt.optimizer.state else None
             for g in opt.groups]  # fmt: skip
    hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in opt.optimizer.param_groups]
    if engine.mtp_config.enabled and engine.stage.size > 1:  # the head's group lives on the last stage
        head = from_last_stage((steps[1:], hyper[1:]) if engine.stage.last else None, engine.pp_group)
        steps, hyper = steps[:1] + head[0], hyper[:1] + head[1]
    return {"steps": steps, "param_groups": hyper}


@torch.no_grad()
def load_optimizer_state(engine, directory: Path, saved: dict) -> None:
    """Read this rank's ranges of the masters (and moments, when saved) from ``directory``, whatever
    the TP x DP layout that wrote them; refresh the params. Collective."""
    opt = engine.optimizer
    buffers = []
    for g, step in zip(opt.groups, saved["steps"]):
        buffers.append({"master": g.master.data})
        if step is None:
            opt.optimizer.state.pop(g.master, None)
            continue
        state = {"step": torch.tensor(step, dtype=torch.float32)}
        state.update((k, torch.zeros_like(g.master.data)) for k in MOMENTS)
        opt.optimizer.state[g.master] = state
        buffers[-1].update((k, state[k]) for k in MOMENTS)
    layout = _layout(engine)
    for state in ("master", *MOMENTS):
        if any(state in b for b in buffers):
            only = [{k: v for k, v in b.items() if k == state} for b in buffers]
            dcp.load(_state_dict(engine, layout, only), checkpoint_id=str(directory / state))
    tp = engine.config.megatron.tp_size
    for index, _, _, replicated, (start, n), _ in layout:
        if replicated and tp > 1 and n:  # TP rank 0 read it; its peers own the same range
            for buffer in buffers[index].values():
                dist.broadcast(
                    buffer[start : start + n], dist.get_global_rank(engine.tp_group, 0), engine.tp_group
                )
    for pg, hyper in zip(opt.optimizer.param_groups, saved["param_groups"]):
        pg.update(hyper)
    opt.refresh_params()
