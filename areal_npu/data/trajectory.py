"""Trajectories as they come back from rollouts, and their training view.

Token in, token out: a trajectory keeps the engine's token ids; nothing is
re-tokenised. Every generated token carries the weight version that produced it and its behaviour
log-prob. Tool or environment tokens of multi-turn episodes sit in the response with
``loss_mask`` 0, version -1 and log-prob 0.

The training view is *token-aligned*: position i of every per-token tensor describes token i of
``prompt + response`` (``logp[i] = log p(ids[i] | ids[<i])``); position 0 has no log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal_npu.data.sample import TrainSample


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    behave_logprobs: list[float]  # one per response token (0.0 where loss_mask is 0)
    versions: list[int]  # weight version that produced each response token (-1: not generated)
    reward: float = 0.0
    loss_mask: list[int] | None = None  # per response token; None: every response token is trained
    group_id: int = 0  # trajectories of one prompt share a group (GRPO)
    finish_reason: str = ""
    meta: dict = field(default_factory=dict)
    # earlier token sequences of the same episode (an agent harness rewrote its history, so they are not
    # a prefix of this one): trained as samples of their own with this trajectory's advantage
    segments: list[Trajectory] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.response_ids)
        for name in ("behave_logprobs", "versions") + (("loss_mask",) if self.loss_mask is not None else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} response tokens")
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty: the first token has no context to be predicted from")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def response_mask(self) -> list[int]:
        return [1] * len(self.response_ids) if self.loss_mask is None else list(self.loss_mask)

    def oldest_version(self) -> int:
        """The oldest weight version among trained tokens (-1 if none): what staleness is judged by."""
        trained = [v for t in (*self.segments, self) for v, m in zip(t.versions, t.response_mask()) if m and v >= 0]
        return min(trained) if trained else -1


def training_sample(traj: Trajectory, advantage: float) -> TrainSample:
    """Token-aligned tensors of one trajectory, ready for the train engine."""
    p = len(traj.prompt_ids)
    zeros_f = [0.0] * p
    return TrainSample(
        input_ids=torch.tensor(traj.prompt_ids + traj.response_ids, dtype=torch.long),
        loss_mask=torch.tensor([0] * p + traj.response_mask(), dtype=torch.bool),
        behave_logp=torch.tensor(zeros_f + list(traj.behave_logprobs), dtype=torch.float32),
        versions=torch.tensor([-1] * p + list(traj.versions), dtype=torch.long),
        advantage=torch.tensor(float(advantage), dtype=torch.float32),
    )


def sft_sample(prompt_ids: list[int], answer_ids: list[int]) -> TrainSample:
    """A supervised pair: loss on the answer tokens only."""
    ids = list(prompt_ids) + list(answer_ids)
    return TrainSample(
        input_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.tensor([0] * len(prompt_ids) + [1] * len(answer_ids), dtype=torch.bool),
    )
