"""Hugging Face weights written tensor by tensor into the published layout: safetensors shards of at
most ``max_shard_bytes`` (``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``,
or one ``model.safetensors`` when everything fits in one shard), what transformers and vLLM load.

Nothing holds more than the tensor being added: each tensor's bytes are appended to the open shard's
data file as it arrives; a full shard gets its header (names, dtypes, shapes, offsets, known only
then) and its data copied behind it in fixed-size blocks. A tensor larger than the limit gets a
shard of its own (as ``save_pretrained`` does).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "INDEX_FILE", "ShardedSafetensorsWriter"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", transformers' default
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip
_COPY_BLOCK = 8 << 20


class ShardedSafetensorsWriter:
    """``add(name, tensor)`` one at a time, then ``finish()`` (returns the files written)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        for old in [
            *self.out.glob("model-*-of-*.safetensors"),
            self.out / SINGLE_FILE,
            self.out / INDEX_FILE,
        ]:
            old.unlink(missing_ok=True)  # a previous export into the same folder
        self.limit = max_shard_bytes
        self.shards: list[tuple[Path, dict[str, dict]]] = []  # (finished file, its header)
        self._data, self._header, self._size = None, {}, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._header and self._size + nbytes > self.limit:
            self._close_shard()
        if self._data is None:
            self._data = open(self.out / f".shard{len(self.shards)}.data", "wb")
        if nbytes:
            self._data.write(t.reshape(-1).view(torch.uint8).numpy().data)
        entry = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self._size, self._size + nbytes],
        }
        self._header[name] = entry
        self._size += nbytes

    def _close_shard(self) -> None:
        data_path = Path(self._data.name)
        self._data.close()
        header = json.dumps(
            {"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")
        ).encode()
        header += b" " * (-len(header) % 8)  # aligned data, as the safetensors writer pads
        path = self.out / f".shard{len(self.shards)}.safetensors"
        with open(path, "wb") as f, open(data_path, "rb") as data:
            f.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, f, _COPY_BLOCK)
        data_path.unlink()
        self.shards.append((path, self._header))
        self._data, self._header, self._size = None, {}, 0

    def finish(self) -> list[Path]:
        if self._data is not None or not self.shards:
            if self._data is None:
                self._data = open(self.out / f".shard{len(self.shards)}.data", "wb")
            self._close_shard()
        n = len(self.shards)
        if n == 1:
            os.replace(self.shards[0][0], self.out / SINGLE_FILE)
            return [self.out / SINGLE_FILE]
        files, weight_map, total = [], {}, 0
        for i, (path, header) in enumerate(self.shards):
            final = self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, final)
            files.append(final)
            for name, entry in header.items():
                weight_map[name] = final.name
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return files
