"""The training view of a trajectory (:class:`TrainSample`), cut to the micro-batch cap
(``on_too_long="truncate"``)."""

import dataclasses

import pytest
import torch

from areal_npu.data.sample import TrainSample, truncate_sample
from areal_npu.data.trajectory import Trajectory, training_sample


def test_truncate_keeps_the_first_tokens_of_every_per_token_field():
    traj = Trajectory([1, 2, 3], [4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], [0, 0, 1, 1], loss_mask=[1, 0, 1, 1])
    cut = truncate_sample(training_sample(traj, 0.5), 5)
    # reference: the lists of the trajectory, sliced by hand
    assert cut.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert cut.loss_mask.tolist() == [False, False, False, True, False]
    assert cut.behave_logp.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.1, -0.2])
    assert cut.versions.tolist() == [-1, -1, -1, 0, 0]
    assert float(cut.advantage) == 0.5  # per sample: unchanged


def test_truncate_leaves_short_samples_and_refuses_misaligned_fields():
    sample = TrainSample(input_ids=torch.arange(4), loss_mask=torch.ones(4, dtype=torch.bool))
    assert truncate_sample(sample, 4) is sample
    # a field already cut to the cap passes (proximal log-probs computed on the cut sample)
    cut = truncate_sample(dataclasses.replace(sample, prox_logp=torch.zeros(3)), 3)
    assert [len(cut.input_ids), len(cut.loss_mask), len(cut.prox_logp)] == [3, 3, 3]
    with pytest.raises(ValueError, match="prox_logp has 2 rows"):
        truncate_sample(dataclasses.replace(sample, prox_logp=torch.zeros(2)), 3)


def test_a_sample_refuses_per_token_fields_of_another_length():
    with pytest.raises(ValueError, match="loss_mask has shape"):
        TrainSample(input_ids=torch.arange(4), loss_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantage must be a 0-d tensor"):
        TrainSample(input_ids=torch.arange(2), loss_mask=torch.ones(2, dtype=torch.bool), advantage=torch.ones(2))
