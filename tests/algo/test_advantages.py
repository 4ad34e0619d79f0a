import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu import names
from areal_npu.algo.advantages import dr_grpo_advantages, grpo_advantages, sequence_to_token_advantages

REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])


def test_grpo_hand_worked():
    # group 0: mean .5, unbiased std sqrt(4·.25/3) = 1/√3 → ±.5·√3 ; group 1: all equal → 0
    # group 2: mean .25, centred (−.25 ×3, .75), unbiased std sqrt(.75/3) = .5 → (−.5 ×3, 1.5)
    adv, stats = grpo_advantages(REWARDS, 4, eps=0.0)
    s3 = 0.5 * math.sqrt(3)
    expected = [s3, -s3, s3, -s3, 0, 0, 0, 0, -0.5, -0.5, -0.5, 1.5]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert float(stats[names.GRPO_ZERO_ADV_GROUPS]) == 1.0
    assert float(stats[names.GRPO_ZERO_ADV_GROUP_RATIO]) == pytest.approx(1 / 3)


def test_grpo_biased_std_hand_worked():
    # population std: group 0 → .5 → ±1; group 2 → sqrt(.1875) → (−.25, .75)/.4330
    adv, _ = grpo_advantages(REWARDS, 4, unbiased_std=False, eps=0.0)
    sd = math.sqrt(0.1875)
    expected = [1, -1, 1, -1, 0, 0, 0, 0, -0.25 / sd, -0.25 / sd, -0.25 / sd, 0.75 / sd]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_dr_grpo_is_mean_centred_only():
    adv, stats = dr_grpo_advantages(REWARDS, 4)
    expected = [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0, -0.25, -0.25, -0.25, 0.75]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert float(stats[names.GRPO_ZERO_ADV_GROUPS]) == 1.0


def test_equal_groups_are_exactly_zero_even_with_tiny_eps():
    rewards = torch.tensor([0.3, 0.3, 0.3, 7.0, 7.0, 7.0])
    adv, stats = grpo_advantages(rewards, 3, eps=1e-30)
    assert torch.equal(adv, torch.zeros(6))
    assert float(stats[names.GRPO_ZERO_ADV_GROUPS]) == 2.0
    assert float(stats[names.GRPO_ZERO_ADV_GROUP_RATIO]) == 1.0


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(7), 4)


def _naive_grpo(rewards: list[float], n: int, std_normalize: bool, eps: float) -> list[float]:
    out = []
    for g in range(0, len(rewards), n):
        grp = rewards[g : g + n]
        mu = sum(grp) / n
        var = sum((x - mu) ** 2 for x in grp) / (n - 1) if n > 1 else 0.0
        for x in grp:
            if max(grp) == min(grp):
                out.append(0.0)
            elif std_normalize:
                out.append((x - mu) / (math.sqrt(var) + eps))
            else:
                out.append(x - mu)
    return out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    groups=st.integers(1, 5),
    std_normalize=st.booleans(),
    data=st.data(),
)
def test_grpo_matches_naive(n, groups, std_normalize, data):
    rewards = data.draw(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.25]), min_size=n * groups, max_size=n * groups)
    )
    adv, stats = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), n, std_normalize=std_normalize)
    expected = _naive_grpo(rewards, n, std_normalize, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    zero_groups = sum(1 for g in range(groups) if len(set(rewards[g * n : (g + 1) * n])) == 1)
    assert float(stats[names.GRPO_ZERO_ADV_GROUPS]) == zero_groups


def test_broadcast_packed_hand_worked():
    # three sequences of lengths 3, 2, 4; response tokens marked by the mask
    cu = torch.tensor([0, 3, 5, 9])
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    adv = sequence_to_token_advantages(torch.tensor([2.0, -1.0, 0.5]), mask, cu_seqlens=cu)
    torch.testing.assert_close(adv, torch.tensor([0, 2, 2, 0, -1, 0, 0, 0.5, 0.5]))


def test_broadcast_packed_with_trailing_padding_and_padded_layout():
    cu = torch.tensor([0, 2, 3])
    mask = torch.tensor([1, 1, 1, 1, 1], dtype=torch.bool)  # last two tokens are padding (no sequence)
    adv = sequence_to_token_advantages(torch.tensor([1.0, 3.0]), mask, cu_seqlens=cu)
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, 3.0, 0.0, 0.0]))

    mask2d = torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    seg = torch.arange(2)[:, None].expand(2, 3)
    adv2d = sequence_to_token_advantages(torch.tensor([4.0, -2.0]), mask2d, segment_ids=seg)
    torch.testing.assert_close(adv2d, torch.tensor([[0.0, 4.0, 4.0], [-2.0, -2.0, 0.0]]))
