"""A checkpoint's manifest: every file with its size and SHA-256, written last, checked on resume.

The directory rename in ``save_checkpoint`` makes a checkpoint appear whole or not at all while
the machine stays up; it does not protect against what happens after: a power loss before the
page cache reached the disk, a disk filling up, a copy cut short. The manifest lets ``--resume``
tell an intact checkpoint from a damaged one and name the damaged file, instead of failing deep
inside safetensors or ``torch.load``.

Checkpoints written before manifests existed have none. Their directories were still renamed into
place only when complete, so they are not refused; but nothing can prove their bytes, so they get
the checks that need no checksums (the files exist, ``trainer_state.json`` parses, the safetensors
header covers the file exactly) and a warning that they were not verified.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# what a checkpoint cannot be resumed without (rng_rank<r>.pt is optional: load_checkpoint skips it)
REQUIRED_FILES = ("config.json", "model.safetensors", "optim.pt", "trainer_state.json")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path) -> dict[str, dict]:
    """Flush every file of ``directory`` to disk, then write ``manifest.json`` atomically, last.

    The files are synced before their checksums are written down, so that a manifest on disk
    never describes bytes that were still only in memory."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name == MANIFEST:
            continue
        _fsync(path)
        files[name] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    text = json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2)
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)
    return files


def checkpoint_problems(directory: Path) -> list[str]:
    """What is wrong with the checkpoint in ``directory``, each problem naming its file; [] when it
    is intact. Without a manifest (an older checkpoint) only the checks that need no checksums run."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return _structure_problems(directory)
    try:
        manifest = json.loads(manifest_path.read_text())
        listed = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{manifest_path}: unreadable ({exc})"]
    problems = [f"{directory / name}: missing (the manifest lists no such file)" for name in REQUIRED_FILES
                if name not in listed]  # fmt: skip
    for name, expected in listed.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {expected['size']}")
        elif sha256_of(path) != expected["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest (corrupted)")
    return problems


def _structure_problems(directory: Path) -> list[str]:
    from safetensors import safe_open

    problems = [f"{directory / name}: missing" for name in REQUIRED_FILES if not (directory / name).is_file()]
    state = directory / "trainer_state.json"
    if state.is_file():
        try:
            json.loads(state.read_text())["version"]
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{state}: unreadable ({type(exc).__name__}: {exc})")
    weights = directory / "model.safetensors"
    if weights.is_file():
        try:
            with safe_open(str(weights), framework="pt"):
                pass  # opening checks that the header describes exactly the bytes in the file
        except Exception as exc:  # safetensors raises its own error type
            problems.append(f"{weights}: unreadable ({exc})")
    return problems
