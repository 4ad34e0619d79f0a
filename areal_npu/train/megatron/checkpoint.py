"""Atomic, resumable checkpoints of the Megatron engine, in the FSDP2 engine's directory layout.

``<root>/step_<N>/`` holds a Hugging Face checkpoint (``config.json``, ``model.safetensors`` under HF
names: what vLLM and transformers load, whatever the TP layout), ``optim.pt`` (the layout and the
list of optimizer shards), ``optim_tp<r>.pt`` (TP rank ``r``'s AdamW state, keyed by Megatron
parameter name), ``trainer_state.json`` (version, scheduler, the caller's ``extra``),
``rng_rank<r>.pt`` and, written last, ``manifest.json`` (:mod:`areal_npu.train.manifest`). Written
into a temporary directory renamed into place when complete; ``<root>/latest`` then names it, so
:func:`areal_npu.train.checkpoint.latest_checkpoint` and ``checkpoint_to_resume`` work unchanged.

Weights load into any TP layout (they are HF tensors); the optimizer state is per TP shard, so a
resume must keep ``tp_size`` (refused otherwise, naming both sizes).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areal_npu.train.checkpoint import LATEST
from areal_npu.train.manifest import write_manifest
from areal_npu.train.megatron import convert

__all__ = ["load_checkpoint", "save_checkpoint"]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _optimizer_state(engine) -> dict:
    """AdamW state keyed by Megatron parameter name (not by position)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    state = engine.optimizer.state_dict()
    order = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        "order": order,
    }


def save_checkpoint(
    engine, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it)."""
    from safetensors.torch import save_file

    root = Path(root)
    rank = dist.get_rank()
    name = f"step_{engine.version}"
    tmp = root / f".{name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    tensors = dict(engine.full_state_dict())  # collective over TP
    first_replica = dist.get_rank(engine.dp_cp_group) == 0  # one copy of each TP shard
    if first_replica:
        torch.save(_optimizer_state(engine), tmp / f"optim_tp{engine.tp_rank}.pt")
    torch.save(
        {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        tmp / f"rng_rank{rank}.pt",
    )
    if rank == 0:
        engine.hf_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tp = engine.config.tp_size
        torch.save({"tp_size": tp, "shards": [f"optim_tp{r}.pt" for r in range(tp)]}, tmp / "optim.pt")
        state = {"version": engine.version, "scheduler": engine.scheduler.state_dict(), "extra": extra or {}}
        _write_atomic(tmp / "trainer_state.json", json.dumps(state, indent=2, default=str))
    _barrier()
    final = root / name
    if rank == 0:
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, name)
        steps = sorted(
            (p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
        )
        for old in steps[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(engine, path: str | Path) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG from ``path``; returns ``extra``."""
    from safetensors.torch import load_file

    path = Path(path)
    index = torch.load(path / "optim.pt", weights_only=False)
    if index["tp_size"] != engine.config.tp_size:
        raise ValueError(
            f"{path}: optimizer state was saved with tp_size={index['tp_size']}, this engine runs "
            f"tp_size={engine.config.tp_size}; resume with the same tp_size"
        )
    hf = load_file(str(path / "model.safetensors"))
    state = convert.hf_to_mcore(hf, engine.shape, engine.tp_rank, engine.config.tp_size)
    named = dict(engine.module.named_parameters())
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
    trainer = json.loads((path / "trainer_state.json").read_text())
    engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.version = int(trainer["version"])
    rng = path / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        s = torch.load(rng, weights_only=False)
        torch.set_rng_state(s["torch"])
        random.setstate(s["python"])
        np.random.set_state(s["numpy"])
    return trainer["extra"]
