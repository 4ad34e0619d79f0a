"""Atomic, resumable checkpoints of the Megatron engine, in the FSDP2 engine's directory layout.

``<root>/step_<N>/`` holds a Hugging Face checkpoint (``config.json``, ``model.safetensors`` under HF
names: what vLLM and transformers load, whatever the TP layout), ``optim.pt`` (the layout and the
list of optimizer shards), ``optim_tp<r>.pt`` (TP rank ``r``'s AdamW state, keyed by Megatron
parameter name), ``trainer_state.json`` (version, scheduler, the caller's ``extra``),
``rng_rank<r>.pt`` and, written last, ``manifest.json`` (:mod:`areal_npu.train.manifest`), through the
directory protocol of :func:`areal_npu.train.checkpoint.write_checkpoint` (temporary directory renamed
into place when complete, then ``latest``), so ``checkpoint_to_resume`` works unchanged.

Weights load into any TP layout (they are HF tensors); the optimizer state is per TP shard, so a
resume must keep ``tp_size`` (refused otherwise, naming both sizes).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from areal_npu.train.checkpoint import read_trainer_state, write_checkpoint
from areal_npu.train.megatron import convert

__all__ = ["load_checkpoint", "save_checkpoint", "write_hf_checkpoint"]


def _optimizer_state(engine) -> dict:
    """AdamW state keyed by Megatron parameter name (not by position)."""
    names = {id(p): n for n, p in engine.named_mcore_parameters().items()}  # the MTP layer's too
    state = engine.optimizer.state_dict()
    order = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        "order": order,
    }


def write_hf_checkpoint(engine, out_dir: str | Path, tokenizer=None, tensors: dict | None = None) -> Path:
    """The weights as a Hugging Face checkpoint (``config.json``, ``model.safetensors``, the
    tokenizer). Collective over TP unless ``tensors`` (HF names) is given; only rank 0 writes."""
    from safetensors.torch import save_file

    tensors = dict(engine.full_state_dict()) if tensors is None else tensors
    out = Path(out_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        engine.hf_config.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def save_checkpoint(
    engine, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it)."""

    def write_files(tmp: Path) -> None:
        tensors = dict(engine.full_state_dict())  # collective over TP
        if dist.get_rank(engine.dp_cp_group) == 0:  # one copy of each TP shard
            torch.save(_optimizer_state(engine), tmp / f"optim_tp{engine.tp_rank}.pt")
        write_hf_checkpoint(engine, tmp, tokenizer, tensors)
        if dist.get_rank() == 0:
            tp = engine.config.megatron.tp_size
            torch.save({"tp_size": tp, "shards": [f"optim_tp{r}.pt" for r in range(tp)]}, tmp / "optim.pt")

    state = {"version": engine.version, "scheduler": engine.scheduler.state_dict(), "extra": extra or {}}
    return write_checkpoint(root, engine.version, write_files, state, keep_last)


def load_checkpoint(engine, path: str | Path) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG from ``path``; returns ``extra``."""
    from safetensors.torch import load_file

    path = Path(path)
    index = torch.load(path / "optim.pt", weights_only=False)
    if index["tp_size"] != engine.config.megatron.tp_size:
        raise ValueError(
            f"{path}: optimizer state was saved with tp_size={index['tp_size']}, this engine runs "
            f"tp_size={engine.config.megatron.tp_size}; resume with the same tp_size"
        )
    hf = load_file(str(path / "model.safetensors"))
    head = {n: hf.pop(n) for n in list(hf) if n.startswith("mtp.")}
    state = convert.hf_to_mcore(hf, engine.shape, engine.tp_rank, engine.config.megatron.tp_size)
    if engine.mtp is not None:
        from areal_npu.train.megatron.engine import MTP_MODULE
        from areal_npu.train.megatron.mtp import mtp_hf_to_mcore

        state.update((MTP_MODULE + n, t) for n, t in mtp_hf_to_mcore(head, engine.shape).items())
    named = engine.named_mcore_parameters()
    with torch.no_grad():
        for name, tensor in state.items():
            named[name].copy_(tensor)
    saved = torch.load(path / f"optim_tp{engine.tp_rank}.pt", weights_only=False)
    current = _optimizer_state(engine)
    if saved["order"] != current["order"]:
        raise ValueError(f"{path}: optimizer parameters differ from this engine's")
    position = {n: i for i, n in enumerate(current["order"])}
    engine.optimizer.load_state_dict(
        {
            "state": {position[n]: s for n, s in saved["state"].items()},
            "param_groups": [
                dict(g, params=list(own["params"]))
                for g, own in zip(saved["param_groups"], engine.optimizer.state_dict()["param_groups"])
            ],
        }
    )
    trainer = read_trainer_state(path)
    engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.version = int(trainer["version"])
    return trainer["extra"]
