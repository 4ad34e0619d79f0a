"""Weight buckets: size bound respected, every tensor exactly once, wire format exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu.rollout.buckets import (
    iter_buckets,
    pack_bucket,
    split_policy_and_draft,
    tensor_bytes,
    unpack_bucket,
)

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


def test_pack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    bucket = [
        ("model.layers.0.mlp.up_proj.weight", torch.randn(8, 4, generator=g)),
        ("lm_head.weight", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
        ("mtp.fc.weight", torch.randn(4, 8, generator=g)[:, ::2]),  # non-contiguous view
    ]
    back = unpack_bucket(pack_bucket(bucket))
    assert [n for n, _ in back] == sorted(n for n, _ in bucket) or {n for n, _ in back} == {
        n for n, _ in bucket
    }
    by_name = dict(back)
    for name, tensor in bucket:
        assert by_name[name].dtype == tensor.dtype and torch.equal(by_name[name], tensor)


def test_split_policy_and_draft():
    names = [
        "model.embed_tokens.weight",
        "mtp.fc.weight",
        "lm_head.weight",
        "mtp.layers.0.mlp.up_proj.weight",
    ]
    policy, draft = split_policy_and_draft((n, torch.zeros(1)) for n in names)
    assert [n for n, _ in policy] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert [n for n, _ in draft] == ["mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight"]
