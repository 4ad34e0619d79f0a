"""A checkpoint's manifest: every file with its size and CRC-32, written last, checked on resume.

Each rank describes the files it wrote itself (``rng_rank<r>.pt``, its ``__<r>_<n>.distcp``
optimizer shard: :func:`own_entries`, after an fsync), rank 0 the shared ones; rank 0 writes the
manifest from the gathered entries after a barrier, so no rank reads another's files at save time.
CRC-32 (zlib) detects a damaged or truncated file at a fraction of SHA-256's cost; it is not a
defence against deliberate tampering. Manifests of format 1 (SHA-256) are still checked.

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

import json
import os
import re
import zlib
from pathlib import Path

from areal_npu.digest import sha256_of

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # 1: sha256 per file; 2: crc32
# what a checkpoint cannot be resumed without (rng_rank<r>.pt is optional: load_checkpoint skips it)
REQUIRED_FILES = ("config.json", "optim.pt", "trainer_state.json")
#: the weights: one file, or shards listed in an index (either one is required)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_of(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def writer_rank(name: str) -> int:
    """The rank that wrote file ``name`` (relative path): its RNG state or optimizer shard, else 0."""
    found = re.fullmatch(r"(?:.*/)?(?:rng_rank(\d+)\.pt|__(\d+)_\d+\.distcp)", name)
    return int(next(g for g in found.groups() if g is not None)) if found else 0


def own_entries(directory: Path, rank: int) -> dict[str, dict]:
    """Size and CRC-32 of the files of ``directory`` that ``rank`` wrote, each flushed to disk first
    (a manifest on disk never describes bytes that were only in memory)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name != MANIFEST and writer_rank(name) == rank:
            _fsync(path)
            files[name] = {"size": path.stat().st_size, "crc32": crc32_of(path)}
    return files


def write_manifest(directory: Path, files: dict[str, dict] | None = None) -> dict[str, dict]:
    """Write ``manifest.json`` atomically, last: ``files`` (every rank's :func:`own_entries`), or,
    when not given, every file of ``directory`` described here."""
    if files is None:
        files = {}
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            name = path.relative_to(directory).as_posix()
            if name != MANIFEST:
                _fsync(path)
                files[name] = {"size": path.stat().st_size, "crc32": crc32_of(path)}
    text = json.dumps({"format": MANIFEST_FORMAT, "files": dict(sorted(files.items()))}, indent=2)
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
    if not any(name in listed for name in WEIGHTS):
        problems.append(f"{directory / WEIGHTS[0]}: missing (the manifest lists no weights)")
    for name, expected in listed.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {expected['size']}")
        elif "crc32" in expected and crc32_of(path) != expected["crc32"]:
            problems.append(f"{path}: CRC-32 differs from the manifest (corrupted)")
        elif "sha256" in expected and sha256_of(path) != expected["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest (corrupted)")
    return problems


def _structure_problems(directory: Path) -> list[str]:
    from safetensors import safe_open

    problems = [f"{directory / name}: missing" for name in REQUIRED_FILES if not (directory / name).is_file()]
    if not any((directory / name).is_file() for name in WEIGHTS):
        problems.append(f"{directory / WEIGHTS[0]}: missing")
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
