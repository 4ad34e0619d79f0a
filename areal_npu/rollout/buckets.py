"""The wire format of a weight bucket, and which tensors go to the drafter.

A bucket (a list of ``(name, tensor)``, sized by :func:`areal_npu.data.buckets.iter_buckets`) travels
as safetensors bytes: no pickle of tensors; names and dtypes survive exactly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

import torch

from areal_npu.names import MTP_PREFIX


def split_policy_and_draft(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Checkpoint names ``mtp.*`` belong to the MTP drafter (a separate module in vLLM); the rest to the policy."""
    policy, draft = [], []
    for name, tensor in named_tensors:
        (draft if name.startswith(MTP_PREFIX) else policy).append((name, tensor))
    return policy, draft


#: safetensors' names of the dtypes :func:`pack_bucket` writes itself (others: safetensors' writer)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """The bucket as safetensors bytes, written in one copy: the header, then each tensor's bytes
    joined straight from its memory (safetensors' own writer holds two more copies of the bucket
    while it packs: a sync's peak host memory counts them)."""
    tensors = [(name, t.detach().to("cpu").contiguous()) for name, t in bucket]
    if any(t.dtype not in SAFETENSORS_DTYPES for _, t in tensors):
        from safetensors.torch import save

        return save(dict(tensors))
    header, offset = {}, 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    raw = (memoryview(t.reshape(-1).view(torch.uint8).numpy()) for _, t in tensors)
    return b"".join([struct.pack("<Q", len(text)), text, *raw])


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(payload).items())
