"""The train-engine interface: what the controller, the warm start and ``run.py`` may call.

Two engines implement it: :class:`areal_npu.train.fsdp2.FSDPEngine` (FSDP2) and
:class:`areal_npu.train.megatron.engine.MegatronEngine` (Megatron-Core); one is built by
:func:`areal_npu.train.factory.build_engine`. Nothing outside ``areal_npu/train/`` reaches past
these members (``tests/train/test_protocol.py`` checks both the engines and the callers).

Collective semantics: **every rank calls every method**, in the same order, each with its own
share of the batch (the ranks of one tensor/context-parallel group pass the same samples). Methods
marked *collective* communicate; a rank that skips one deadlocks the others. Stats are global:
reduced by the engine over the ranks that hold different tokens, the same on every rank.

Samples are token-aligned :class:`areal_npu.data.sample.TrainSample`; the loss is an object
(:class:`areal_npu.train.losses.Loss`: ``PPOLoss(cfg)``, ``SFTLoss()``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor

from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES
from areal_npu.data.sample import TrainSample
from areal_npu.train.losses import Loss

__all__ = ["TrainEngine"]


@runtime_checkable
class TrainEngine(Protocol):
    #: weight version: optimizer steps taken (one per ``train_step``); what the rollout engines serve
    version: int
    #: the MTP head being trained with the policy, or ``None`` (``export_buckets`` then has no ``mtp``)
    mtp: object | None

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[Tensor]:
        """Token-aligned log-probs of every sample under the current weights (position 0 is 0),
        cut to the packing cap as the step will be. Collective."""
        ...

    def forward_backward(
        self, samples: Sequence[TrainSample], loss: Loss, step: int | None = None
    ) -> dict[str, float]:
        """Accumulate the gradients of ``loss`` (plus the MTP loss when the head trains) over
        packed micro-batches, normalised by global counts; returns global stats. Collective."""
        ...

    def optimizer_step(self, step: int | None = None, bump_version: bool = True) -> dict[str, float]:
        """Clip, check (a non-finite norm raises and applies nothing) and apply the gradients;
        bumps ``version`` when asked. Collective."""
        ...

    def train_step(
        self, samples: Sequence[TrainSample], loss: Loss, step: int | None = None
    ) -> dict[str, float]:
        """``forward_backward`` + ``optimizer_step`` per PPO mini-batch; ``version`` bumps once. Collective."""
        ...

    def full_state_dict(self) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face name, full CPU float32 tensor) of every trained weight. Collective: every rank iterates."""
        ...

    def export_buckets(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, kinds: Sequence[str] = ("policy", "mtp")
    ) -> Iterator[tuple[str, list[tuple[str, Tensor]]]]:
        """The weights for the rollout sync as ``(kind, [(checkpoint name, tensor), ...])`` buckets
        of at most ``bucket_bytes`` (one tensor may exceed it), ``kind`` in ``kinds``. Collective."""
        ...

    def save_checkpoint(
        self, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
    ) -> Path:
        """``<root>/step_<version>``: a Hugging Face checkpoint vLLM serves plus optimizer,
        scheduler, RNG and ``extra``, written atomically (:mod:`areal_npu.train.checkpoint`);
        ``latest`` then names it and only ``keep_last`` remain. Collective."""
        ...

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore weights, optimizer, scheduler, version and RNG from a checkpoint of
        :meth:`save_checkpoint`; returns its ``extra``. Collective."""
        ...

    def save_hf_checkpoint(self, out_dir: str | Path, tokenizer=None) -> Path:
        """The weights alone as a Hugging Face checkpoint (with ``mtp.*`` when there is a head) in
        the layout the model came from; what the warm start hands the engines. Collective; rank 0 writes."""
        ...
