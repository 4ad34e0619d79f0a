"""The weights of a sync as a stream: produced bucket by bucket, sent, dropped.

A sync never holds the model whole, on the trainer's ranks or in the controller: the trainer's
``export_buckets`` gathers one bucket at a time (a collective every trainer rank iterates) and the
transports send each bucket before they draw the next. Every try of a sync, and the re-sync of an
engine restarted since, iterates the trainer's export again (:class:`WeightStream`).

An iteration that stops early (an engine failed mid-sync) must still be run to its end: the other
trainer ranks are in the same export's collectives. :func:`streaming` closes it, and a
:class:`WeightStream` drains its source on close, sending nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from areal_npu.data.buckets import iter_kind_buckets
from areal_npu.names import EAGLE3_PREFIX, MTP_PREFIX

Named = tuple[str, torch.Tensor]

__all__ = ["WeightStream", "iter_target_buckets", "streaming"]


class WeightStream:
    """Re-iterable ``(name, tensor)`` pairs: each iteration calls ``source()`` anew (the trainer's
    export), so no copy outlives a sync. Closing an iteration early drains the source."""

    def __init__(self, source: Callable[[], Iterable[Named]]):
        self.source = source

    def __iter__(self) -> Iterator[Named]:
        pairs = iter(self.source())
        try:
            for pair in pairs:  # noqa: UP028 - ``yield from`` would close the source on close, not drain it
                yield pair
        finally:
            for _ in pairs:  # collective on every trainer rank: finish it, send nothing
                pass


@contextmanager
def streaming(named: Iterable[Named]):
    """An iterator over ``named`` that is closed (a :class:`WeightStream` drained) on exit."""
    pairs = iter(named)
    try:
        yield pairs
    finally:
        close = getattr(pairs, "close", None)
        if close is not None:
            close()


def iter_target_buckets(
    pairs: Iterable[Named], max_bytes: int, sync_draft: bool = True
) -> Iterator[tuple[str, list[Named]]]:
    """``(target, bucket)`` in stream order: ``draft`` for the drafter's ``mtp.*`` tensors and the
    EAGLE-3 drafter's ``eagle3.*`` ones (sent without the prefix: vLLM's ``Eagle3LlamaForCausalLM``
    takes ``fc.weight``, ``midlayer.*``, ``norm.weight``), both skipped unless ``sync_draft``;
    ``policy`` for the rest. A bucket holds one target."""
    targets = (_target(n) + (t,) for n, t in pairs)
    yield from iter_kind_buckets(((k, n, t) for k, n, t in targets if sync_draft or k == "policy"), max_bytes)


def _target(name: str) -> tuple[str, str]:
    if name.startswith(EAGLE3_PREFIX):
        return "draft", name[len(EAGLE3_PREFIX) :]
    return ("draft" if name.startswith(MTP_PREFIX) else "policy"), name
