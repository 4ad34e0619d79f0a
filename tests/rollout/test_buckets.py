"""Weight buckets on the wire: the format is exact, drafter tensors split off by name."""

from __future__ import annotations

import torch

from areal_npu.rollout.buckets import pack_bucket, split_policy_and_draft, unpack_bucket


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
