"""The FSDP2 engine's checkpoints (:meth:`areal_npu.train.fsdp2.FSDPEngine.save_checkpoint`), in the
directory protocol of :mod:`areal_npu.train.checkpoint` (the Megatron engine's layout):

- the Hugging Face checkpoint in the layout and dtype the model came from (a published checkpoint
  keeps its outer config, ``model.language_model.*`` names, untouched vision tower and declared
  ``bfloat16``: the fp32 masters are written rounded to it), streamed one tensor
  at a time (each gathered over the FSDP ranks, written by rank 0) into shards of at most 5 GB with
  an index (:mod:`areal_npu.model.hf_shards`): what vLLM and transformers load;
- ``optim/``: torch.distributed.checkpoint (DCP) directories, ``master`` (the fp32 parameters, the
  module's sharded state dict: ``get_model_state_dict``), then one per optimizer state tensor
  (``exp_avg``, ``exp_avg_sq``: ``get_optimizer_state_dict``), each rank writing the rows of its
  own FSDP2 shards (``__<rank>_0.distcp``); no rank gathers them. One DCP save a state: DCP's
  writer copies a shard that is a view of a larger buffer (FSDP2's padded parameters) and keeps the
  copies until the save ends, so a save's extra memory is one state's shards, not all three;
- ``optim.pt`` (rank 0, small): the format, the DP size that saved, each parameter's scalar states
  (AdamW's ``step``) and the param groups' hyper-parameters, under parameter names.

A resume at any DP size reads the rows its own shards cover from ``optim/`` (DCP reshards), so the
fp32 parameters and moments come back bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from areal_npu.train.checkpoint import OPTIM_DIR, read_trainer_state, write_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint", "write_eagle3_drafter", "write_hf_checkpoint"]

FORMAT = "fsdp2-dcp"
MASTER = "master"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def write_hf_checkpoint(engine, out_dir: str | Path, tokenizer=None, max_shard_bytes=None) -> Path:
    """The engine's weights (the fp32 masters, with ``mtp.*``) as a Hugging Face checkpoint that
    vLLM loads as is, in the layout and the dtype the engine's model came from (a published bf16
    checkpoint: the masters rounded to bf16; :meth:`areal_npu.model.layout.CheckpointLayout.save`),
    streamed one tensor at a time into shards of at most ``max_shard_bytes``. Collective (every
    rank takes part in each tensor's gather); only rank 0 writes."""
    tensors = engine.full_state_dict()
    out = Path(out_dir)
    limit = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    if _rank() == 0:
        if engine.mtp is not None:
            engine.lm.config.mtp_num_hidden_layers = engine.mtp.num_layers
        engine.layout.save(out, tensors, engine.lm.config, tokenizer, **limit)
    else:
        for _ in tensors:  # the collectives of the gather
            pass
    return out


def write_eagle3_drafter(engine, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """The engine's EAGLE-3 drafter as it holds it now (the fp32 masters, rounded to ``dtype``) in
    the directory vLLM's ``speculative_config={"method": "eagle3", "model": out_dir}`` loads
    (:func:`areal_npu.model.eagle3.save_eagle3_drafter`). Collective (every rank takes part in each
    tensor's gather); only rank 0 writes."""
    from areal_npu.model.eagle3 import Eagle3Drafter, save_eagle3_drafter
    from areal_npu.names import EAGLE3_PREFIX

    if engine.eagle3 is None:
        raise ValueError("the engine trains no EAGLE-3 drafter (eagle3.enabled)")
    tensors = {n.removeprefix(EAGLE3_PREFIX): t for n, t in engine.eagle3_state_dict()}
    if _rank() == 0:
        held = Eagle3Drafter(engine.eagle3.config)
        held.load_state_dict(tensors)
        save_eagle3_drafter(held, out_dir, dtype)
    return Path(out_dir)


def _optimizer_parts(engine) -> tuple[dict[str, dict[str, DTensor]], dict]:
    """({state name: {param name: sharded tensor}}, what ``optim.pt`` records); none before a step
    (``get_optimizer_state_dict`` would take an initialising step on an empty optimizer)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    if not engine.optimizer.state:
        return {}, {"scalars": {}, "param_groups": groups}
    osd = get_optimizer_state_dict(engine.module, engine.optimizer)
    tensors: dict[str, dict[str, DTensor]] = {}
    scalars = {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, DTensor):
                tensors.setdefault(key, {})[name] = value
            else:
                scalars.setdefault(name, {})[key] = value
    return tensors, {"scalars": scalars, "param_groups": osd["param_groups"]}


def save_checkpoint(
    engine, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it)."""

    def write_files(tmp: Path) -> None:
        dcp.save(get_model_state_dict(engine.module), checkpoint_id=str(tmp / OPTIM_DIR / MASTER))
        states, index = _optimizer_parts(engine)
        for key, by_name in sorted(states.items()):
            dcp.save(by_name, checkpoint_id=str(tmp / OPTIM_DIR / key))
        write_hf_checkpoint(engine, tmp, tokenizer)
        if _rank() == 0:
            names = set(index["scalars"]).union(*states.values())
            saved = {n: sorted(k for k, s in states.items() if n in s) for n in sorted(names)}
            index.update(format=FORMAT, dp_size=dist.get_world_size(), tensor_states=saved)
            torch.save(index, tmp / "optim.pt")

    state = {"version": engine.version, "scheduler": engine.scheduler.state_dict(), "extra": extra or {}}
    return write_checkpoint(root, engine.version, write_files, state, keep_last)


@torch.no_grad()
def _load_optimizer(engine, directory: Path, index: dict) -> None:
    """This rank's shards of every saved optimizer state, read into tensors shaped and placed like
    the parameters (DCP reads the saved rows they cover), then handed to the optimizer."""
    params = dict(engine.module.named_parameters())
    by_key: dict[str, dict[str, DTensor]] = {}
    state = {name: dict(index["scalars"].get(name, {})) for name in index["tensor_states"]}
    for name, keys in index["tensor_states"].items():
        for key in keys:
            state[name][key] = by_key.setdefault(key, {})[name] = torch.zeros_like(params[name])
    for key, by_name in sorted(by_key.items()):
        dcp.load(by_name, checkpoint_id=str(directory / key))
    if state:
        set_optimizer_state_dict(
            engine.module, engine.optimizer, {"state": state, "param_groups": index["param_groups"]}
        )
    else:  # saved before the first step
        engine.optimizer.state.clear()
        for group, hyper in zip(engine.optimizer.param_groups, index["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})


def load_checkpoint(engine, path: str | Path) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG from ``path`` at this engine's DP size
    (any); returns the caller's ``extra`` state. Collective."""
    path = Path(path)
    index = torch.load(path / "optim.pt", weights_only=False)
    found = index.get("format") if isinstance(index, dict) else None
    if found != FORMAT:
        writer = "the Megatron engine" if found == OPTIM_DIR else "an older areal-npu (one whole optim.pt)"
        raise ValueError(
            f"{path}: written by {writer}, not the FSDP2 engine's sharded {OPTIM_DIR}/; resume it "
            "with what wrote it, or start from its model.safetensors"
        )
    model = get_model_state_dict(engine.module)
    dcp.load(model, checkpoint_id=str(path / OPTIM_DIR / MASTER))
    set_model_state_dict(engine.module, model)
    _load_optimizer(engine, path / OPTIM_DIR, index)
    trainer = read_trainer_state(path)
    engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.version = int(trainer["version"])
    return trainer["extra"]
