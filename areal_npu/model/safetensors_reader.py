"""Read a safetensors checkpoint tensor by tensor, and a tensor by row / column range, with plain
file reads: what a rank loads is its own shard, never the whole model.

A checkpoint is one ``*.safetensors`` file or several listed in ``model.safetensors.index.json``.
Only the files' headers (JSON: name -> dtype, shape, byte offsets) are read up front. A row range
is one contiguous read straight into the returned tensor; a column range is read a block of rows
at a time (at most ``block_bytes`` beyond the result).

Why not ``safe_open(...).get_slice``: it maps the file, and every page a slice touches counts in
the process's resident memory until the file is closed (a column half of a 128 MiB tensor touched
all 256 MiB, measured with safetensors 0.8 here); reads keep the resident memory to the result.
The file format is safetensors' own (8-byte little-endian header length, JSON header, row-major
data); the tests check every read against ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["INDEX_FILE", "SafetensorsReader"]

INDEX_FILE = "model.safetensors.index.json"
BLOCK_BYTES = 16 << 20
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file


def _header(path: Path) -> dict[str, _Entry]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {
        name: _Entry(path, DTYPES[h["dtype"]], tuple(h["shape"]), 8 + size + h["data_offsets"][0])
        for name, h in header.items()
    }


class SafetensorsReader:
    """The tensors of the checkpoint in ``model_dir``, read on demand by name."""

    def __init__(self, model_dir: str | Path, block_bytes: int = BLOCK_BYTES):
        model_dir = Path(model_dir)
        index = model_dir / INDEX_FILE
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        self.entries: dict[str, _Entry] = {}
        for name in files:
            self.entries.update(_header(model_dir / name))
        self.block_bytes = block_bytes

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def _entry(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {name!r}") from None

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None, out=None) -> torch.Tensor:
        """Tensor ``name[rows]`` (``[rows, cols]`` for ``cols``): a new contiguous tensor, or ``out``
        (contiguous, of the tensor's dtype) filled in place. Slices have step 1; ``cols`` needs at
        least 2 dimensions."""
        e = self._entry(name)
        shape = e.shape or (1,)
        r0, r1, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError("row slices have step 1")
        row_numel = 1
        for n in shape[1:]:
            row_numel *= n
        itemsize = torch.empty((), dtype=e.dtype).element_size()
        row_bytes = row_numel * itemsize
        with open(e.path, "rb", buffering=0) as f:
            if cols is None:
                want = (r1 - r0, *shape[1:]) if e.shape else ()
                out = _target(out, want, e.dtype, name)
                _read_into(f, e.begin + r0 * row_bytes, out)
                return out
            if len(shape) < 2:
                raise ValueError(f"{name}: a column range needs 2 or more dimensions, shape {e.shape}")
            c0, c1, step = cols.indices(shape[1])
            if step != 1:
                raise ValueError("column slices have step 1")
            out = _target(out, (r1 - r0, c1 - c0, *shape[2:]), e.dtype, name)
            per_block = max(1, self.block_bytes // max(row_bytes, 1))
            buffer = torch.empty((min(per_block, r1 - r0), *shape[1:]), dtype=e.dtype)
            for start in range(r0, r1, per_block):
                block = buffer[: min(r1, start + per_block) - start]
                _read_into(f, e.begin + start * row_bytes, block)
                out[start - r0 : start - r0 + len(block)] = block[:, c0:c1]
            return out


def _target(out, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name}: cannot read {tuple(shape)} {dtype} into {tuple(out.shape)} {out.dtype}")
    return out


def _read_into(f, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous tensor ``out`` with the bytes at ``offset`` of the open file ``f``."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise EOFError(f"{f.name}: truncated at byte {offset + done}")
        done += n
