import pytest
import torch

from areal_npu.algo.guard import NonFiniteError, nonfinite_guard

NAN, INF = float("nan"), float("inf")


def test_raise_names_step_and_tensor():
    with pytest.raises(NonFiniteError, match=r"step 42: tensor 'advantages'") as info:
        nonfinite_guard(
            42,
            per_sample={"rewards": torch.tensor([1.0, 0.0])},
            per_token={"advantages": torch.tensor([0.1, NAN, INF, 0.2])},
        )
    assert info.value.step == 42 and info.value.tensor == "advantages"
    assert "1 NaN, 1 Inf" in str(info.value)


def test_raise_on_rewards():
    with pytest.raises(NonFiniteError, match="'rewards'"):
        nonfinite_guard("7", per_sample={"rewards": torch.tensor([-INF, 1.0])})


def test_clean_inputs_pass_and_masked_positions_are_ignored():
    mask = torch.tensor([True, False, True])
    assert (
        nonfinite_guard(0, per_token={"logp_behave": torch.tensor([-1.0, NAN, -2.0])}, token_mask=mask)
        is None
    )
    with pytest.raises(NonFiniteError):
        nonfinite_guard(0, per_token={"logp_behave": torch.tensor([-1.0, NAN, -2.0])})


def test_drop_mode_returns_keep_mask_per_sample():
    cu = torch.tensor([0, 2, 5, 7])
    logp = torch.tensor([-1.0, -1.0, -1.0, INF, -1.0, -1.0, -1.0])
    rewards = torch.tensor([1.0, 0.0, 1.0])
    keep = nonfinite_guard(
        3, per_sample={"rewards": rewards}, per_token={"logp_prox": logp}, cu_seqlens=cu, mode="drop"
    )
    assert keep.tolist() == [True, False, True]
    rewards[2] = NAN
    keep = nonfinite_guard(
        3, per_sample={"rewards": rewards}, per_token={"logp_prox": logp}, cu_seqlens=cu, mode="drop"
    )
    assert keep.tolist() == [True, False, False]


def test_drop_mode_raises_when_nothing_is_left():
    with pytest.raises(NonFiniteError, match="step 5.*rewards"):
        nonfinite_guard(5, per_sample={"rewards": torch.tensor([NAN, INF])}, mode="drop")


def test_bad_mode():
    with pytest.raises(ValueError, match="on_nonfinite"):
        nonfinite_guard(0, per_sample={"r": torch.ones(1)}, mode="skip")
