"""What the two train engines share: samples under the cap, packed micro-batches, the body of a
step's forward/backward, its stats, and the optimizer step's stats.

:class:`TrainEngineBase` is written once for :class:`areal_npu.train.fsdp2.FSDPEngine` and
:class:`areal_npu.train.megatron.engine.MegatronEngine`; each engine fills in the few steps that
differ (how a packed micro-batch reaches the device, how the model computes its log-probs, how the
gradients are accumulated and reduced, the MTP head's targets). The contract is
:class:`areal_npu.train.protocol.TrainEngine`. Inside, every sequence is shifted to prediction
alignment (position t predicts token t+1) before packing, so no target crosses a packed segment;
losses are normalised by global counts summed over micro-batches and data-parallel ranks, so
micro-batching and sharding never change the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from areal_npu import names
from areal_npu.algo.guard import NonFiniteError
from areal_npu.data.packed_layout import PackedBatch, pack_sequences, unpack_per_token
from areal_npu.data.packing import packing_stats, plan_micro_batches
from areal_npu.data.sample import TrainSample, truncate_sample
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.mtp_params import mtp_mode
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import all_reduce_sum
from areal_npu.train.forward import MTPArgs, prediction_fields
from areal_npu.train.losses import Loss
from areal_npu.train.stats import merge_stats, minibatch_train_step

__all__ = ["EXPORT_KINDS", "TrainEngineBase", "check_export_kinds", "optimizer_stats", "refuse_non_finite"]

#: What ``export_buckets`` may be asked for: the policy, the MTP head or the EAGLE-3 drafter (vLLM
#: loads a drafter apart; the FSDP2 engine trains EAGLE-3), a published checkpoint's carried vision tower.
EXPORT_KINDS = ("policy", "mtp", "eagle3", "vision")

#: ``mb_loss(mb, logp, entropy, aux=None, aux_stats=None) -> (total, (loss tokens, stats))``
MicroBatchLoss = Callable[..., tuple[torch.Tensor, tuple[float, dict[str, float]]]]


def check_export_kinds(kinds: Sequence[str]) -> None:
    unknown = sorted(set(kinds) - set(EXPORT_KINDS))
    if unknown:
        raise ValueError(f"unknown export kinds {unknown}; expected policy, mtp, eagle3 or vision")


def refuse_non_finite(norms: Sequence[float], step: int, zero_grad: Callable[[], None]) -> None:
    """A non-finite gradient norm drops the accumulated gradients and raises: nothing is applied."""
    if not all(math.isfinite(n) for n in norms):
        zero_grad()
        raise NonFiniteError(step, "grad_norm", f"step {step}: gradient norms {list(norms)}; update not applied")


def optimizer_stats(grad_norm: float, lr: float, version: int) -> dict[str, float]:
    """The stats of one optimizer step: the policy's gradient norm (before clipping), the learning
    rate after the scheduler's step, the weight version."""
    return {names.TRAIN_GRAD_NORM: grad_norm, names.TRAIN_LR: lr, names.TRAIN_VERSION: float(version)}


class TrainEngineBase:
    """The scaffolding of a train engine. A subclass sets the attributes below in its constructor
    and implements the ``_``-prefixed hooks that raise ``NotImplementedError``."""

    config: TrainEngineConfig
    mtp_config: MTPConfig
    pad_token_id: int
    version: int  # weight version: optimizer steps taken
    #: ranks holding different samples: micro-batch counts are planned and loss counts summed over it
    #: (``None``: every rank)
    dp_group = None
    #: ranks holding different tokens: the step's stats are merged over it (``None``: every rank)
    stats_group = None

    # ---- hooks ----------------------------------------------------------------------------------
    def _check_loss(self, loss: Loss) -> None:
        """Refuse a loss this engine's layout cannot compute, before any work."""

    def _check_same_samples(self, samples: Sequence[TrainSample]) -> None:
        """Refuse ranks that must pass the same samples but do not."""

    def _to_device(self, packed: PackedBatch, fields: dict[str, torch.Tensor]):
        """One packed micro-batch (host side) as this rank feeds it to the model."""
        raise NotImplementedError

    def _loss_cu_seqlens(self, mb) -> torch.Tensor | None:
        """The segment boundaries of ``mb`` the loss sees (``None``: a share without whole segments)."""
        raise NotImplementedError

    def _packed_logprobs(self, mbs: list) -> Iterable[tuple[PackedBatch, torch.Tensor]]:
        """Per micro-batch its host layout and the prediction-aligned log-probs of its whole row
        (float32 on the CPU), under the current weights."""
        raise NotImplementedError

    def _mtp_args(self, plan: list, mbs: list, samples: Sequence[TrainSample]) -> list[MTPArgs | None]:
        """Per micro-batch the MTP head's loss arguments (``None``: the head does not train); the
        FSDP2 engine gives ``(MTP, EAGLE-3)`` pairs, handed back to its own :meth:`_accumulate`."""
        return [None] * len(mbs)

    def _accumulate(self, mbs: list, mtp_args: list, mb_loss: MicroBatchLoss) -> list[tuple[float, dict]]:
        """Run forward and backward over ``mbs`` (gradients summed over the data-parallel ranks);
        returns each micro-batch's ``(loss tokens, stats)`` from ``mb_loss``."""
        raise NotImplementedError

    # ---- batching -------------------------------------------------------------------------------
    def _fit_cap(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """``on_too_long="truncate"``: every sample keeps its first ``max_tokens_per_mb`` tokens
        (all per-token fields alike), so planner, packed layout, loss and MTP labels see the same
        tokens. ``"error"``: unchanged; the planner refuses a sequence over the cap."""
        if self.config.packing.on_too_long != "truncate":
            return list(samples)
        return [truncate_sample(s, self.config.packing.max_tokens_per_mb) for s in samples]

    def _micro_batches(self, samples: Sequence[TrainSample], loss: Loss | None) -> tuple[list, list, dict]:
        """(plan, micro-batches as this rank feeds them, packing stats); the fields of ``loss``
        (none: the targets only) packed prediction-aligned, each row padded to the alignment (and
        each sequence for context parallelism, ``packing.cp_size``)."""
        packing = self.config.packing
        lengths = [len(s) for s in samples]
        plan = plan_micro_batches(lengths, packing, group=self.dp_group)
        mbs = []
        pad_total = 0
        for indices in plan:
            seqs = [samples[i] for i in indices]
            packed = pack_sequences(
                [s.input_ids for s in seqs],
                alignment=packing.alignment,
                cp_size=packing.cp_size,
                pad_token_id=self.pad_token_id,
                sample_indices=indices,
            )
            pad_total += packed.pad_tokens
            mbs.append(self._to_device(packed, prediction_fields(seqs, packed, loss)))
        stats = packing_stats(lengths, [p for p in plan if p], packing.max_tokens_per_mb, pad_total)
        return plan, mbs, stats

    # ---- public operations ----------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """Token-aligned log-probs of every sample under the current weights (position 0 is 0).

        With ``on_too_long="truncate"`` a sample over the cap gets log-probs for its first
        ``max_tokens_per_mb`` tokens only: the tokens the train step trains on."""
        samples = self._fit_cap(samples)
        self._check_same_samples(samples)
        plan, mbs, _ = self._micro_batches(samples, None)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for indices, (packed, full) in zip(plan, self._packed_logprobs(mbs)):
            for i, pred in zip(indices, unpack_per_token(full, packed)):
                out[i] = torch.cat([pred.new_zeros(1), pred[:-1]])  # prediction -> token alignment
        return out

    def train_step(self, samples: Sequence[TrainSample], loss: Loss, step: int | None = None) -> dict[str, float]:
        """One training step on this rank's ``samples``: ``ppo_minibatches`` optimizer steps over
        interleaved slices (each normalised by its own global counts), one weight-version bump.
        Returns global stats (see :meth:`forward_backward`), averaged over the mini-batches."""
        return minibatch_train_step(self, samples, loss, step, self.config.ppo_minibatches)

    def forward_backward(
        self, samples: Sequence[TrainSample], loss: Loss, step: int | None = None
    ) -> dict[str, float]:
        """Accumulate the gradients of one step over packed micro-batches; returns global stats.

        ``loss`` (:class:`areal_npu.train.losses.PPOLoss`, :class:`~areal_npu.train.losses.SFTLoss`)
        says which sample fields it reads and computes each micro-batch's loss; the MTP auxiliary
        loss is added when the head trains (with ``mtp.mtp_only`` it alone makes the gradient).
        """
        self._check_loss(loss)
        step = self.version if step is None else step
        truncated = sum(len(s) > self.config.packing.max_tokens_per_mb for s in samples)  # local, like packing/*
        samples = loss.check(self._fit_cap(samples), step)
        self._check_same_samples(samples)
        plan, mbs, pack_stats = self._micro_batches(samples, loss)

        # global counts over the data-parallel ranks (copies of a batch count once); the shifted
        # mask: token t carries the loss of predicting it from t - 1
        n_tokens = all_reduce_sum([float(sum(int(s.loss_mask[1:].sum()) for s in samples))], self.dp_group)[0]
        n_seqs = all_reduce_sum([float(sum(bool(s.loss_mask[1:].any()) for s in samples))], self.dp_group)[0]
        denominator = loss.denominator(n_tokens, n_seqs)
        mtp_args = self._mtp_args(plan, mbs, samples)
        policy_trains = mtp_mode(self.mtp_config) != "mtp_only"

        def mb_loss(mb, logp, entropy, aux=None, aux_stats=None):
            main, stats = loss(
                logp, entropy, mb.fields, denominator=denominator, cu_seqlens=self._loss_cu_seqlens(mb),
                policy_version=self.version,
            )  # fmt: skip
            stats.update(aux_stats or {})
            if not policy_trains:  # the head alone trains: the policy's loss is reported, not followed
                main = main.detach() * 0
            return (main if aux is None else main + aux), (float(mb.fields["loss_mask"].sum()), stats)

        stats = merge_stats(self._accumulate(mbs, mtp_args, mb_loss), self.stats_group)
        stats.update(pack_stats)
        if self.config.packing.on_too_long == "truncate":
            stats[names.PACKING_TRUNCATED_SEQUENCES] = float(truncated)
        stats[names.TRAIN_N_TOKENS] = n_tokens
        return stats
