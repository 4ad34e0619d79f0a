import math

import pytest
import torch

from areal_npu.algo.aggregation import aggregate_loss, kl_estimate
from areal_npu.algo.segments import segment_ids_from_cu_seqlens


def test_segment_ids_from_cu_seqlens_pads_with_minus_one():
    seg = segment_ids_from_cu_seqlens(torch.tensor([0, 2, 2, 5]), total_tokens=7)
    assert seg.tolist() == [0, 0, 2, 2, 2, -1, -1]
    with pytest.raises(ValueError):
        segment_ids_from_cu_seqlens(torch.tensor([1, 3]))


def test_token_mean_and_seq_mean_hand_worked():
    # seq 0: tokens 0..2 (valid 1,2), seq 1: tokens 3..4 (valid 3), seq 2: 5..6 (no valid token)
    loss = torch.tensor([9.0, 1.0, 3.0, 4.0, 7.0, 5.0, 5.0])
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    cu = torch.tensor([0, 3, 5, 7])
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx((1 + 3 + 4) / 3)
    assert float(aggregate_loss(loss, mask, "token-mean", global_denominator=8)) == pytest.approx(1.0)
    # seq-mean: (mean(1,3) + mean(4)) / 2 sequences with valid tokens
    assert float(aggregate_loss(loss, mask, "seq-mean", cu_seqlens=cu)) == pytest.approx((2 + 4) / 2)
    assert float(
        aggregate_loss(loss, mask, "seq-mean", cu_seqlens=cu, global_denominator=6)
    ) == pytest.approx(1.0)


def test_masked_nan_does_not_leak_into_value_or_grad():
    loss = torch.tensor([1.0, float("nan"), 2.0, float("inf")], requires_grad=True)
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.bool)
    out = aggregate_loss(loss, mask, "seq-mean", segment_ids=torch.tensor([0, 0, 1, 1]))
    out.backward()
    assert out.item() == pytest.approx(1.5)
    assert torch.isfinite(loss.grad).all()
    assert loss.grad.tolist() == [0.5, 0.0, 0.5, 0.0]


def test_empty_batch_gives_zero_not_nan():
    loss = torch.ones(3)
    mask = torch.zeros(3, dtype=torch.bool)
    assert float(aggregate_loss(loss, mask, "token-mean")) == 0.0
    assert float(aggregate_loss(loss, mask, "seq-mean", segment_ids=torch.zeros(3, dtype=torch.long))) == 0.0


def test_kl_estimators_hand_worked():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # δ = ref − logp = (−0.5, 1.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor(k3))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, ref, "k4")


def test_unknown_mode_names_the_key():
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate_loss(torch.ones(2), torch.ones(2, dtype=torch.bool), "sum")
