"""Atomic, resumable checkpoints of the Megatron engine, in the FSDP2 engine's directory layout.

``<root>/step_<N>/`` holds a Hugging Face checkpoint (``config.json``, the weights under HF names in
the published layout: ``model.safetensors`` or shards of at most ``max_shard_bytes`` with
``model.safetensors.index.json``; what vLLM and transformers load, whatever the TP layout; streamed
tensor by tensor from the compute-dtype params, gathered over TP one tensor at a time, in the
dtype the checkpoint's config declares), ``optim/``
(the fp32 masters and AdamW moments, each rank writing the slices it owns: :mod:`.dist_optim`),
``optim.pt`` (the layout, AdamW's step counts and hyper-parameters), ``trainer_state.json``
(version, scheduler, the caller's ``extra``), ``rng_rank<r>.pt`` and, written last,
``manifest.json`` (:mod:`areal_npu.train.manifest`), through the directory protocol of
:func:`areal_npu.train.checkpoint.write_checkpoint` (temporary directory renamed into place when
complete, then ``latest``), so ``checkpoint_to_resume`` works unchanged.

A resume reads the masters and moments of its own ranges from ``optim/`` whatever the TP, DP x CP
and pipeline layout that saved them (resharding: the keys carry global layer indices; the pipeline
refuses the MTP head and tied embeddings, so every stage has one parameter group with the same step).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.distributed as dist

from areal_npu.data.buckets import iter_kind_buckets
from areal_npu.train.base import check_export_kinds
from areal_npu.train.checkpoint import OPTIM_DIR, read_trainer_state, write_checkpoint
from areal_npu.train.megatron import convert
from areal_npu.train.megatron.dist_optim import load_optimizer_state, save_optimizer_state
from areal_npu.train.megatron.pipeline import from_last_stage

__all__ = ["export_buckets", "load_checkpoint", "save_checkpoint", "write_hf_checkpoint"]


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
        if "mtp" in kinds and engine.mtp_config.enabled:
            head = engine.mtp_hf_tensors(lambda: dict(engine.mtp.named_parameters()))
            yield from (("mtp", n, t) for n, t in head)
        if "vision" in kinds:
            yield from (("vision", n, t) for n, t in engine.layout.carried.items())

    yield from iter_kind_buckets(named(), bucket_bytes)


def write_hf_checkpoint(engine, out_dir: str | Path, tokenizer=None, max_shard_bytes=None) -> Path:
    """The weights as a Hugging Face checkpoint in the layout the model came from (``config.json``,
    the weights in shards, a published checkpoint's vision tower and processor files, the
    tokenizer), from the params in the compute dtype, written in the dtype the checkpoint declares
    (:meth:`areal_npu.model.layout.CheckpointLayout.save`: bf16 for a published one). Collective
    (every rank gathers one tensor at a time over TP and pipeline stages); only rank 0 writes."""
    out = Path(out_dir)
    limit = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    params = dict(engine.module.named_parameters())
    policy = convert.gathered_hf_tensors(params, engine.shape, engine.tp_group, engine.pp_group)
    head = engine.mtp_hf_tensors(lambda: dict(engine.mtp.named_parameters())) if engine.mtp_config.enabled else ()
    tensors = itertools.chain(policy, head)
    if dist.get_rank() == 0:
        engine.layout.save(out, tensors, engine.hf_config, tokenizer, **limit)
    else:
        for _ in tensors:  # the collectives of the gather
            pass
    return out


def save_checkpoint(
    engine, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it)."""

    def write_files(tmp: Path) -> None:
        saved = save_optimizer_state(engine, tmp / OPTIM_DIR)  # each rank its own slices
        write_hf_checkpoint(engine, tmp, tokenizer)
        if dist.get_rank() == 0:
            layout = engine.config.megatron
            index = {"format": OPTIM_DIR, "tp_size": layout.tp_size, "pp_size": layout.pp_size,
                     "dp_cp_size": engine.optimizer.world, **saved}  # fmt: skip
            torch.save(index, tmp / "optim.pt")

    scheduler = engine.scheduler.state_dict()
    if engine.mtp_config.enabled and engine.stage.size > 1:  # the stage holding every parameter group
        scheduler = from_last_stage(scheduler, engine.pp_group)
    state = {"version": engine.version, "scheduler": scheduler, "extra": extra or {}}
    return write_checkpoint(root, engine.version, write_files, state, keep_last)


def load_checkpoint(engine, path: str | Path) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG from ``path``; returns ``extra``."""
    path = Path(path)
    index = torch.load(path / "optim.pt", weights_only=False)
    if index.get("format") != OPTIM_DIR:
        raise ValueError(
            f"{path}: written by an older areal-npu (one optimizer file per TP x DP rank, not {OPTIM_DIR}/); "
            "resume it with that version, or start from its model.safetensors"
        )
    load_optimizer_state(engine, path / OPTIM_DIR, index)
    trainer = read_trainer_state(path)
    groups = len(engine.optimizer.optimizer.param_groups)  # a stage without the MTP head: the policy's
    engine.scheduler.load_state_dict(
        {k: v[:groups] if isinstance(v, list) else v for k, v in trainer["scheduler"].items()}
    )
    engine.version = int(trainer["version"])
    return trainer["extra"]
