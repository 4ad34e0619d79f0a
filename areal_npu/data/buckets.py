"""Size-bounded buckets of named tensors: the one loop every weight push and export runs.

A bucket is a list of ``(name, tensor)`` whose total byte size stays within ``max_bytes``; a single
tensor larger than the bound travels alone in its own bucket (it cannot be split without the
receiver knowing how to reassemble it). Every tensor lands in exactly one bucket, in input order,
so a layer's tensors stay together (vLLM's layer-wise reload processes a layer once all of its
tensors have arrived). :func:`iter_kind_buckets` adds a kind per tensor (policy, MTP head, vision
tower) and never mixes two kinds in one bucket: the engines load each kind apart.

It is a layout of data, not a transport: the train engines bucket their exports with it and the
rollout client buckets its pushes with it (:mod:`areal_npu.rollout.buckets` holds the wire format).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "iter_buckets", "iter_kind_buckets", "tensor_bytes"]

#: The default bound of one bucket (``rollout.weight_bucket_bytes``, the engines' ``export_buckets``).
DEFAULT_BUCKET_BYTES = 256 << 20


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_kind_buckets(
    named: Iterable[tuple[Hashable, str, torch.Tensor]], max_bytes: int
) -> Iterator[tuple[Hashable, list[tuple[str, torch.Tensor]]]]:
    """``(kind, bucket)`` from ``(kind, name, tensor)`` in order: greedy, each bucket's total
    ``<= max_bytes`` unless it holds one oversized tensor, and a new bucket whenever the kind
    changes. A name seen twice is refused (a receiver would load one of them)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0; got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    current = None
    seen: set[str] = set()
    for kind, name, tensor in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        nbytes = tensor_bytes(tensor)
        if bucket and (kind != current or size + nbytes > max_bytes):
            yield current, bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        current = kind
    if bucket:
        yield current, bucket


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Greedy in-order bucketing of one kind: :func:`iter_kind_buckets` without the kinds."""
    for _, bucket in iter_kind_buckets(((None, n, t) for n, t in named_tensors), max_bytes):
        yield bucket
