"""Weight buckets: size bound respected, every tensor exactly once, kinds never mixed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu.data.buckets import iter_buckets, iter_kind_buckets, tensor_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 300), st.sampled_from(DTYPES)), min_size=0, max_size=40),
    max_bytes=st.integers(1, 2000),
)
def test_bucketing_bound_and_exactly_once(sizes, max_bytes):
    tensors = [(f"w{i}", torch.zeros(n, dtype=dt)) for i, (n, dt) in enumerate(sizes)]
    buckets = list(iter_buckets(tensors, max_bytes))
    flat = [name for bucket in buckets for name, _ in bucket]
    assert flat == [name for name, _ in tensors]  # each exactly once, order kept
    for bucket in buckets:
        total = sum(tensor_bytes(t) for _, t in bucket)
        assert bucket and (total <= max_bytes or len(bucket) == 1)  # only a lone oversized tensor exceeds
    # greedy: a bucket closes only when the next tensor would not fit
    for current, following in zip(buckets, buckets[1:], strict=False):
        total = sum(tensor_bytes(t) for _, t in current)
        assert total + tensor_bytes(following[0][1]) > max_bytes


def test_duplicate_names_and_bad_bound_rejected():
    with pytest.raises(ValueError, match="twice"):
        list(iter_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 100))
    with pytest.raises(ValueError):
        list(iter_buckets([], 0))


@settings(max_examples=100, deadline=None)
@given(
    items=st.lists(st.tuples(st.sampled_from(["policy", "mtp", "vision"]), st.integers(1, 300)), max_size=30),
    max_bytes=st.integers(1, 2000),
)
def test_kind_buckets_hold_one_kind_and_keep_order(items, max_bytes):
    named = [(kind, f"w{i}", torch.zeros(n)) for i, (kind, n) in enumerate(items)]
    buckets = list(iter_kind_buckets(named, max_bytes))
    assert [(k, n) for k, bucket in buckets for n, _ in bucket] == [(k, n) for k, n, _ in named]
    for kind, bucket in buckets:
        assert all(dict((n, k) for k, n, _ in named)[name] == kind for name, _ in bucket)
        assert sum(tensor_bytes(t) for _, t in bucket) <= max_bytes or len(bucket) == 1
    # a bucket closes only on a kind change or when the next tensor would not fit
    for (kind, current), (following_kind, following) in zip(buckets, buckets[1:], strict=False):
        total = sum(tensor_bytes(t) for _, t in current)
        assert kind != following_kind or total + tensor_bytes(following[0][1]) > max_bytes
