"""The FSDP2 engine's checkpoints (:meth:`areal_npu.train.fsdp2.FSDPEngine.save_checkpoint`), in the
directory protocol of :mod:`areal_npu.train.checkpoint`: the Hugging Face checkpoint in the layout
the model came from (a published checkpoint keeps its outer config, ``model.language_model.*``
names and untouched vision tower) and ``optim.pt``, the full (unsharded) optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from areal_npu.train.checkpoint import read_trainer_state, write_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint", "write_hf_checkpoint"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def write_hf_checkpoint(engine, out_dir: str | Path, tokenizer=None, tensors: dict | None = None) -> Path:
    """The engine's weights as a Hugging Face checkpoint (with ``mtp.*``) that vLLM loads as is, in
    the layout the engine's model came from. ``tensors``: the full state under training names.
    Collective unless ``tensors`` is given; only rank 0 writes."""
    tensors = dict(engine.full_state_dict()) if tensors is None else tensors
    out = Path(out_dir)
    if _rank() == 0:
        if engine.mtp is not None:
            engine.lm.config.mtp_num_hidden_layers = engine.mtp.num_layers
        engine.layout.save(out, tensors.items(), engine.lm.config, tokenizer)
    return out


def save_checkpoint(
    engine, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it)."""

    def write_files(tmp: Path) -> None:
        tensors = dict(engine.full_state_dict())  # collective
        optim = get_optimizer_state_dict(
            engine.module, engine.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        write_hf_checkpoint(engine, tmp, tokenizer, tensors)
        if _rank() == 0:
            torch.save(optim, tmp / "optim.pt")

    state = {"version": engine.version, "scheduler": engine.scheduler.state_dict(), "extra": extra or {}}
    return write_checkpoint(root, engine.version, write_files, state, keep_last)


def load_checkpoint(engine, path: str | Path) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG from ``path``; returns the caller's
    ``extra`` state. Collective."""
    from safetensors.torch import load_file

    path = Path(path)
    tensors = load_file(str(path / "model.safetensors"))
    module_state = {}
    for name in engine.module.state_dict():
        source = engine.layout.checkpoint_name(name[len("lm.") :] if name.startswith("lm.") else name)
        if source in tensors:
            module_state[name] = tensors[source]
    missing = [n for n in engine.module.state_dict() if n not in module_state and "rotary_emb" not in n]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    set_model_state_dict(
        engine.module, module_state, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    optim = torch.load(path / "optim.pt", weights_only=False)
    set_optimizer_state_dict(
        engine.module, engine.optimizer, optim, options=StateDictOptions(full_state_dict=True)
    )
    state = read_trainer_state(path)
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.version = int(state["version"])
    return state["extra"]
