"""What the train engines take: :class:`TrainSample`, one token-aligned training sequence.

Token-aligned: position ``i`` of every per-token tensor describes token ``i`` of the sequence
(``logp[i] = log p(ids[i] | ids[<i])``); position 0 has no log-prob. The engines shift every field
to prediction alignment themselves, per sequence, before packing.

Built by :func:`areal_npu.data.trajectory.training_sample` (RL: behaviour log-probs, versions, the
advantage) and :func:`areal_npu.data.trajectory.sft_sample` (supervised: ids and loss mask only);
``prox_logp`` is filled in by the trainer from the engine's ``compute_logprobs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

__all__ = ["TrainSample", "truncate_sample"]


@dataclass(eq=False)  # tensors have no single truth value: samples compare by identity
class TrainSample:
    input_ids: Tensor  # [n] long: prompt + response token ids, as the engine produced them
    loss_mask: Tensor  # [n] bool: the tokens the loss trains on
    behave_logp: Tensor | None = None  # [n] float32: behaviour log-prob per token (0 where not generated)
    versions: Tensor | None = None  # [n] long: weight version that produced each token (-1: not generated)
    advantage: Tensor | None = None  # 0-d float32: the sequence's advantage
    # [n] float32: log-probs under the weights before the step (the engine's compute_logprobs); over
    # the packing cap it may already be cut to the cap (compute_logprobs truncates as the step does)
    prox_logp: Tensor | None = None

    #: fields with one row per token (``truncate_sample`` cuts them all alike)
    PER_TOKEN: ClassVar[tuple[str, ...]] = ("input_ids", "loss_mask", "behave_logp", "versions", "prox_logp")

    def __post_init__(self) -> None:
        n = len(self)
        for name in ("loss_mask", "behave_logp", "versions"):
            value = getattr(self, name)
            if value is not None and (value.dim() != 1 or value.shape[0] != n):
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}; one entry per token ({n}) is expected"
                )
        if self.advantage is not None and self.advantage.dim() != 0:
            raise ValueError(f"advantage must be a 0-d tensor, got shape {tuple(self.advantage.shape)}")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def require(self, *names: str) -> None:
        """Raise ``ValueError`` naming the first of ``names`` this sample lacks (a loss's inputs)."""
        for name in names:
            if getattr(self, name) is None:
                hint = " (fill it from the engine's compute_logprobs)" if name == "prox_logp" else ""
                raise ValueError(f"the sample has no {name}{hint}")


def truncate_sample(sample: TrainSample, max_tokens: int) -> TrainSample:
    """The first ``max_tokens`` tokens of ``sample`` (``packing.on_too_long="truncate"``).

    Every per-token field keeps its first ``max_tokens`` rows, so ids, loss mask, behaviour/proximal
    log-probs and versions stay aligned; the advantage passes through, and so does a per-token
    field already cut to ``max_tokens``. A sample that fits is returned as it is.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(sample)
    if n <= max_tokens:
        return sample
    cut = {}
    for name in TrainSample.PER_TOKEN:
        value = getattr(sample, name)
        if value is None or value.shape[0] == max_tokens:
            continue
        if value.shape[0] != n:
            raise ValueError(
                f"{name} has {value.shape[0]} rows; a per-token field needs {n} (or {max_tokens} once truncated)"
            )
        cut[name] = value[:max_tokens]
    return dataclasses.replace(sample, **cut)
