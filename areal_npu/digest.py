"""Content digests of files: one place for the sha256 a task set's pinned sources and a checkpoint's
manifest are checked by (``hashlib.file_digest`` would do it, but needs Python 3.11)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["sha256_of"]


def sha256_of(path: str | Path) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB blocks (any size in bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
