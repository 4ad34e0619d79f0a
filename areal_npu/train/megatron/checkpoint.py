"""Atomic, resumable checkpoints of the Megatron engine, in the FSDP2 engine's directory layout.

``<root>/step_<N>/`` holds a Hugging Face checkpoint (``config.json``, ``model.safetensors`` under HF
names: what vLLM and transformers load, whatever the TP layout; written from the fp32 masters),
``optim.pt`` (the layout and the list of optimizer shards), ``optim_tp<t>_dp<r>.pt`` (TP rank
``t`` and DP x CP rank ``r``'s slices of the AdamW moments; ``optim_pp<p>_tp<t>_dp<r>.pt`` with
pipeline stages,
:meth:`.precision.MasterOptimizer.state_shard`, with the Megatron parameter names of its flat
layout), ``trainer_state.json`` (version, scheduler, the caller's ``extra``),
``rng_rank<r>.pt`` and, written last, ``manifest.json`` (:mod:`areal_npu.train.manifest`), through the
directory protocol of :func:`areal_npu.train.checkpoint.write_checkpoint` (temporary directory renamed
into place when complete, then ``latest``), so ``checkpoint_to_resume`` works unchanged.

Weights load into any TP layout (they are HF tensors) and become the fp32 masters; the optimizer
state is per TP shard and pipeline stage, so a resume must keep ``tp_size`` and ``pp_size`` (refused
otherwise, naming both sizes),
but not the DP x CP size: each rank reads every saved slice of its TP shard and re-slices them
(:meth:`.precision.MasterOptimizer.load_state_shards`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from areal_npu.data.buckets import iter_kind_buckets
from areal_npu.names import MTP_PREFIX
from areal_npu.train.base import check_export_kinds
from areal_npu.train.checkpoint import read_trainer_state, write_checkpoint
from areal_npu.train.megatron import convert
from areal_npu.train.megatron.mtp import MTP_MODULE, mtp_hf_to_mcore, mtp_mcore_to_hf

__all__ = ["export_buckets", "load_checkpoint", "save_checkpoint", "write_hf_checkpoint"]


def _shard_file(tp_rank: int, dp_cp_rank: int, stage=None) -> str:
    pp = f"pp{stage.rank}_" if stage is not None and stage.size > 1 else ""
    return f"optim_{pp}tp{tp_rank}_dp{dp_cp_rank}.pt"


def export_buckets(engine, bucket_bytes: int, kinds):
    """:meth:`MegatronEngine.export_buckets`: ``policy`` buckets, then the head's ``mtp.*`` (a bucket
    holds one kind: vLLM loads the drafter apart), then, only when asked, ``vision`` (a published
    checkpoint's carried vision tower); names of the checkpoint's layout
    (:meth:`areal_npu.model.layout.CheckpointLayout.checkpoint_name`), tensors in the compute dtype
    (the params the forward uses). Collective over every rank."""
    check_export_kinds(kinds)

    def named():
        if "policy" in kinds:
            params = dict(engine.module.named_parameters())
            policy = convert.gathered_hf_tensors(params, engine.shape, engine.tp_group, engine.pp_group)
            yield from (("policy", engine.layout.checkpoint_name(n), t) for n, t in policy)
        if "mtp" in kinds and engine.mtp is not None:
            head = mtp_mcore_to_hf(dict(engine.mtp.named_parameters()), engine.shape, engine.tp_group)
            yield from (("mtp", n, t) for n, t in head)
        if "vision" in kinds:
            yield from (("vision", n, t) for n, t in engine.layout.carried.items())

    yield from iter_kind_buckets(named(), bucket_bytes)


def write_hf_checkpoint(engine, out_dir: str | Path, tokenizer=None, tensors: dict | None = None) -> Path:
    """The weights as a Hugging Face checkpoint in the layout the model came from (``config.json``,
    ``model.safetensors``, a published checkpoint's vision tower and processor files, the tokenizer).
    Collective unless ``tensors`` (training names) is given; only rank 0 writes."""
    tensors = dict(engine.full_state_dict()) if tensors is None else tensors
    out = Path(out_dir)
    if dist.get_rank() == 0:
        engine.layout.save(out, tensors.items(), engine.hf_config, tokenizer)
    return out


def save_checkpoint(
    engine, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it)."""

    def write_files(tmp: Path) -> None:
        tensors = dict(engine.full_state_dict())  # collective over TP
        shard = engine.optimizer.state_shard()  # this rank's slices (every rank writes its own)
        torch.save(shard, tmp / _shard_file(engine.tp_rank, shard["rank"], engine.stage))
        write_hf_checkpoint(engine, tmp, tokenizer, tensors)
        if dist.get_rank() == 0:
            tp, world, pp = engine.config.megatron.tp_size, shard["world"], engine.stage.size
            files = [
                [[_shard_file(t, r, convert.Stage(p, pp)) for r in range(world)] for t in range(tp)]
                for p in range(pp)
            ]
            index = {"tp_size": tp, "pp_size": pp, "dp_cp_size": world, "shards": files}
            torch.save(index, tmp / "optim.pt")

    state = {"version": engine.version, "scheduler": engine.scheduler.state_dict(), "extra": extra or {}}
    return write_checkpoint(root, engine.version, write_files, state, keep_last)


def load_checkpoint(engine, path: str | Path) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG from ``path``; returns ``extra``."""
    from safetensors.torch import load_file

    path = Path(path)
    index = torch.load(path / "optim.pt", weights_only=False)
    layout = engine.config.megatron
    for key in ("tp_size", "pp_size"):
        if index.get(key, 1) != getattr(layout, key):
            raise ValueError(
                f"{path}: optimizer state was saved with {key}={index.get(key, 1)}, this engine runs "
                f"{key}={getattr(layout, key)}; resume with the same {key}"
            )
    named = ((engine.layout.training_name(n), t) for n, t in load_file(str(path / "model.safetensors")).items())
    hf = {n: t for n, t in named if n is not None}  # a published checkpoint's vision tower is carried
    head = {n: hf.pop(n) for n in list(hf) if n.startswith(MTP_PREFIX)}
    state = convert.hf_to_mcore(hf, engine.shape, engine.tp_rank, layout.tp_size, engine.stage)
    if engine.mtp is not None:
        head = mtp_hf_to_mcore(head, engine.shape, engine.tp_rank, engine.config.megatron.tp_size)
        state.update((MTP_MODULE + n, t) for n, t in head.items())
    opt = engine.optimizer  # the fp32 masters from the HF weights (written from them), then the moments
    for i, prefix in enumerate(("", MTP_MODULE)[: len(opt.groups)]):
        opt.load_masters({n: state[prefix + n] for n in opt.names(i)}, i)
    files = index["shards"][engine.stage.rank] if "pp_size" in index else index["shards"]
    shards = [torch.load(path / f, weights_only=False) for f in files[engine.tp_rank]]
    try:
        opt.load_state_shards(shards)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    trainer = read_trainer_state(path)
    engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.version = int(trainer["version"])
    return trainer["extra"]
