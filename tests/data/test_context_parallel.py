"""Zigzag context-parallel split of packed batches, against a chunk-by-chunk reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu.data.context_parallel import (
    cp_gather,
    cp_local_cu_seqlens,
    cp_split,
    cp_split_batch,
    zigzag_indices,
)
from areal_npu.data.packed_layout import pack_per_token, pack_sequences

cp_st = st.integers(min_value=1, max_value=4)
lengths_st = st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=6)


def reference_split(x: torch.Tensor, cu: list[int], cp: int, rank: int) -> torch.Tensor:
    """torch.chunk each segment into 2cp pieces; keep pieces rank and 2cp-1-rank."""
    out = []
    for a, b in zip(cu, cu[1:]):
        chunks = torch.chunk(x[a:b], 2 * cp)
        out += [chunks[rank], chunks[2 * cp - 1 - rank]] if cp > 1 else [x[a:b]]
    return torch.cat(out)


@settings(max_examples=60, deadline=None)
@given(lengths_st, cp_st, st.sampled_from([1, 2]))
def test_split_matches_reference_and_gather_is_identity(lengths, cp, tp):
    alignment = tp * (2 * cp if cp > 1 else 1)
    batch = pack_sequences([torch.randint(0, 50, (n,)) for n in lengths], alignment=alignment, cp_size=cp)
    cu = batch.cu_seqlens.tolist()
    x = torch.randn(batch.total_tokens, 3)
    parts = [cp_split(x, batch.cu_seqlens, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, reference_split(x, cu, cp, r))
        assert part.shape[0] == batch.total_tokens // cp
    assert torch.equal(cp_gather(parts, batch.cu_seqlens), x)
    # every token lands on exactly one rank
    all_idx = torch.cat([zigzag_indices(batch.cu_seqlens, cp, r) for r in range(cp)])
    assert sorted(all_idx.tolist()) == list(range(batch.total_tokens))
    assert cp_local_cu_seqlens(batch.cu_seqlens, cp).tolist() == [c // cp for c in cu]


@settings(max_examples=30, deadline=None)
@given(lengths_st, st.integers(min_value=2, max_value=4))
def test_every_per_token_tensor_splits_the_same_way(lengths, cp):
    batch = pack_sequences([torch.randint(0, 50, (n,)) for n in lengths], alignment=2 * cp, cp_size=cp)
    labels = pack_per_token([torch.randint(0, 50, (n,)) for n in lengths], batch, -100)
    logprobs = pack_per_token([torch.randn(n) for n in lengths], batch, 0.0)
    mtp_mask = pack_per_token([torch.ones(n, dtype=torch.bool) for n in lengths], batch, False)
    fields = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "labels": labels,
        "loss_mask": batch.valid_mask,
        "mtp_labels": labels.roll(-1),
        "mtp_loss_mask": mtp_mask,
        "old_logprobs": logprobs,
        "cu_seqlens": batch.cu_seqlens,
        "num_sequences": len(lengths),
    }
    cu = batch.cu_seqlens.tolist()
    for r in range(cp):
        local = cp_split_batch(fields, batch.cu_seqlens, cp, r)
        for key in (
            "input_ids",
            "position_ids",
            "labels",
            "loss_mask",
            "mtp_labels",
            "mtp_loss_mask",
            "old_logprobs",
        ):
            assert torch.equal(local[key], reference_split(fields[key], cu, cp, r)), key
        assert local["cu_seqlens"].tolist() == [c // cp for c in cu]
        assert local["num_sequences"] == len(lengths)


def test_zigzag_balances_causal_work():
    """Rank r holds chunks r and 2cp-1-r: the causal pairs each rank's queries see are equal."""
    cp, length = 4, 64
    cu = torch.tensor([0, length], dtype=torch.int32)
    work = [int((zigzag_indices(cu, cp, r) + 1).sum()) for r in range(cp)]  # query t sees t + 1 keys
    assert len(set(work)) == 1


def test_segment_not_divisible_fails():
    with pytest.raises(ValueError, match="segment 0 has 6 tokens"):
        zigzag_indices(torch.tensor([0, 6], dtype=torch.int32), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_indices(torch.tensor([0, 8], dtype=torch.int32), 2, 2)
