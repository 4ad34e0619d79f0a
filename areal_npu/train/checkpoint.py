"""Atomic, resumable checkpoints of a train engine: the directory protocol both engines share.

Layout of ``<root>/step_<N>/``: a Hugging Face checkpoint (``config.json``, ``model.safetensors`` or
shards with their index, with the ``mtp.*`` weights, the tokenizer; in the dtype the model's config
declares, bf16 for a published Qwen3.5/3.6) that vLLM and transformers load as is, plus the
engine's fp32 masters and optimizer state (``optim/``: DCP directories, each rank
writing its own shards, and ``optim.pt``, their index: :mod:`areal_npu.train.fsdp2_checkpoint`,
:mod:`areal_npu.train.megatron.checkpoint`), ``trainer_state.json`` (version, scheduler, the
caller's state such as the data position), ``rng_rank<r>.pt`` and, written last,
``manifest.json`` (every file's size and CRC-32, each summed by the rank that wrote it; see ``manifest.py``). :func:`write_checkpoint`
writes everything into a temporary directory that is renamed into place only when complete;
``<root>/latest`` is then replaced atomically. A crash at any point leaves the previous checkpoint
intact and ``latest`` pointing at it; damage that happens later (lost page cache, a full disk) is
caught by the manifest on resume (``checkpoint_to_resume``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from areal_npu.config import ConfigError
from areal_npu.train.manifest import MANIFEST, checkpoint_problems, own_entries, write_manifest

LATEST = "latest"
#: the optimizer state (and fp32 masters) in DCP directories, each rank writing its own shards
OPTIM_DIR = "optim"


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def latest_checkpoint(root: str | Path) -> Path | None:
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if path.is_dir() else None


def _step(path: Path) -> int:
    return int(path.name.split("_")[1])


def checkpoint_to_resume(root: str | Path, warn: Callable[[str], None]) -> Path:
    """The checkpoint ``--resume`` continues from: the one ``latest`` names when it is intact, else
    the newest intact ``step_N`` (each one skipped is reported through ``warn``). Raises
    ``ConfigError`` (exit 2) naming the broken files when no checkpoint is intact."""
    root = Path(root)
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=_step)
    latest = latest_checkpoint(root)
    candidates = ([latest] if latest is not None else []) + [p for p in reversed(steps) if p != latest]
    if not candidates:
        raise ConfigError("--resume", f"no checkpoint under {root} to resume from")
    broken = []
    for path in candidates:
        problems = checkpoint_problems(path)
        if not problems:
            if broken:
                warn(
                    f"resuming from {path.name}, the newest intact checkpoint; skipped: " + "; ".join(broken)
                )
            if not (path / MANIFEST).is_file():
                warn(
                    f"{path} has no {MANIFEST} (written by an older areal-npu): only its structure was checked"
                )
            return path
        broken.append("; ".join(problems))
    raise ConfigError("--resume", f"no intact checkpoint under {root}: " + "; ".join(broken))


def write_checkpoint(
    root: str | Path,
    version: int,
    write_files: Callable[[Path], None],
    trainer_state: dict,
    keep_last: int = 2,
) -> Path:
    """Write ``<root>/step_<version>`` atomically; collective (every rank calls it).

    ``write_files(tmp)`` runs on every rank (each writes its own files, rank 0 the shared ones);
    then every rank's RNG state, rank 0's ``trainer_state.json`` (``trainer_state``: JSON, with
    ``version``, ``scheduler`` and ``extra``), the manifest, the rename and ``latest``; only the
    newest ``keep_last`` checkpoints remain (0: all)."""
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = f"step_{version}"
    tmp = root / f".{name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    write_files(tmp)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        _write_atomic(tmp / "trainer_state.json", json.dumps(trainer_state, indent=2, default=str))
    entries = own_entries(tmp, rank)  # the files this rank wrote, flushed and summed here
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries)  # also the barrier: every rank's files are in place
        entries = {k: v for part in gathered for k, v in part.items()}
    final = root / name
    if rank == 0:
        write_manifest(tmp, entries)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, name)
        steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=_step)
        for old in steps[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_trainer_state(path: str | Path) -> dict:
    """``trainer_state.json`` of a checkpoint (``version``, ``scheduler``, ``extra``), and this
    rank's RNG state restored from it when the checkpoint has one."""
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = path / f"rng_rank{rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())
