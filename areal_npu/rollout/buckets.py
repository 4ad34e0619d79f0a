"""Size-bounded buckets of named tensors for weight sync, and their wire format.

A bucket is a list of ``(name, tensor)`` whose total byte size stays within ``max_bytes``; a single
tensor larger than the bound travels alone in its own bucket (it cannot be split without the
receiver knowing how to reassemble it). Every tensor lands in exactly one bucket, in input order,
so a layer's tensors stay together (vLLM's layer-wise reload processes a layer once all of its
tensors have arrived).

Wire format: safetensors bytes (no pickle of tensors; names and dtypes survive exactly).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

MTP_PREFIX = "mtp."


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Greedy in-order bucketing: each bucket's total ``<= max_bytes`` unless it holds one oversized tensor."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0; got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def split_policy_and_draft(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Checkpoint names ``mtp.*`` belong to the MTP drafter (a separate module in vLLM); the rest to the policy."""
    policy, draft = [], []
    for name, tensor in named_tensors:
        (draft if name.startswith(MTP_PREFIX) else policy).append((name, tensor))
    return policy, draft


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in bucket})


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(payload).items())
