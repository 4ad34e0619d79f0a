"""The train step's loss as an object: what it reads from the samples, how it is normalised, and
the loss of one packed micro-batch. Both engines take one (``train_step(samples, loss, step)``).

Per step an engine: cuts the samples to the packing cap, calls :meth:`Loss.check` (inputs present
and finite), packs ``loss_mask`` and :meth:`Loss.token_fields` prediction-aligned into its
micro-batches, sums the loss-mask tokens and trained sequences over micro-batches and data-parallel
ranks into :meth:`Loss.denominator`, and per micro-batch calls the loss on the policy's log-probs.
A loss that reduces over whole sequences (``needs_whole_sequences``: a seq-mean, a sequence-level
importance weight) needs every token of a sequence in one call, which context parallelism does not
give: an engine with ``cp_size > 1`` refuses it before any work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from areal_npu import names
from areal_npu.algo.guard import nonfinite_guard
from areal_npu.algo.ppo import PPOConfig, decoupled_ppo_loss
from areal_npu.config import ConfigError
from areal_npu.data.sample import TrainSample

__all__ = ["Loss", "PPOLoss", "SFTLoss"]


@runtime_checkable
class Loss(Protocol):
    name: str  # "ppo" | "sft": the prefix of its stats
    needs_whole_sequences: bool

    def check(self, samples: Sequence[TrainSample], step: int) -> list[TrainSample]:
        """The samples to train on (all, unless the loss drops some): raises ``ValueError`` when an
        input is missing, :class:`areal_npu.algo.guard.NonFiniteError` when one is not finite."""
        ...

    def token_fields(self, sample: TrainSample) -> dict[str, tuple[Tensor, float | int | bool]]:
        """Token-aligned ``[n]`` tensors the loss reads, by name, each with its padding value."""
        ...

    def denominator(self, n_tokens: float, n_seqs: float) -> float:
        """The global normaliser of the step from its loss-mask tokens and trained sequences."""
        ...

    def __call__(
        self,
        logp: Tensor,
        entropy: Tensor,
        fields: Mapping[str, Tensor],
        *,
        denominator: float,
        cu_seqlens: Tensor | None,
        policy_version: int,
    ) -> tuple[Tensor, dict[str, float]]:
        """(loss to backpropagate, stats) of one micro-batch: ``logp`` / ``entropy`` ``[t]``
        prediction-aligned, ``fields`` the packed ``loss_mask`` and :meth:`token_fields`;
        ``cu_seqlens`` the segments (``None`` under context parallelism)."""
        ...


class SFTLoss:
    """Token-mean negative log-likelihood of the loss-mask tokens (the supervised warm start)."""

    name = "sft"
    needs_whole_sequences = False

    def check(self, samples: Sequence[TrainSample], step: int) -> list[TrainSample]:
        return list(samples)

    def token_fields(self, sample: TrainSample) -> dict[str, tuple[Tensor, float | int | bool]]:
        return {}

    def denominator(self, n_tokens: float, n_seqs: float) -> float:
        return n_tokens

    def __call__(self, logp, entropy, fields, *, denominator, cu_seqlens, policy_version):
        """``L = -Σ_t mask_t · log π(y_t) / denominator``."""
        mask = fields["loss_mask"]
        loss = -(torch.where(mask, logp, torch.zeros_like(logp))).sum() / max(denominator, 1.0)
        n = max(int(mask.sum()), 1)
        stats = {
            names.SFT_NLL: float(-(logp.detach() * mask).sum() / n),
            names.SFT_ENTROPY: float((entropy.detach() * mask).sum() / n),
        }
        return loss, stats

    def __repr__(self) -> str:
        return "SFTLoss()"


class PPOLoss:
    """Decoupled PPO (:func:`areal_npu.algo.ppo.decoupled_ppo_loss`) under ``config``, normalised by
    the step's global token (token-mean) or sequence (seq-mean) count. Samples carry
    ``behave_logp``, ``prox_logp``, ``versions`` and ``advantage``."""

    name = "ppo"
    INPUTS = ("behave_logp", "prox_logp", "versions", "advantage")

    def __init__(self, config: PPOConfig | None = None):
        self.config = (config or PPOConfig()).validate()
        if self.config.kl_coef > 0:
            raise ConfigError(
                "ppo.kl_coef",
                f"is {self.config.kl_coef}, but the train engines compute no reference-policy log-probs; set 0",
            )
        if self.config.behave_imp_weight_mode == "none" and self.config.behave_imp_weight_level != "token":
            raise ConfigError(  # the level of a weight that is neither clamped nor masked changes nothing
                "ppo.behave_imp_weight_level", "is read only with ppo.behave_imp_weight_mode clamp or mask"
            )
        if self.config.kl_estimator != PPOConfig.kl_estimator:  # read only with the KL term above
            raise ConfigError(
                "ppo.kl_estimator", "is read only with ppo.kl_coef > 0, which no train engine supports"
            )

    @property
    def needs_whole_sequences(self) -> bool:
        c = self.config
        sequence_weight = (
            c.decoupled and c.behave_imp_weight_mode != "none" and c.behave_imp_weight_level == "sequence"
        )
        return c.loss_agg == "seq-mean" or sequence_weight

    def whole_sequence_key(self) -> str:
        """The option that makes the loss need whole sequences (what a refusal names)."""
        return "ppo.loss_agg" if self.config.loss_agg == "seq-mean" else "ppo.behave_imp_weight_level"

    def check(self, samples: Sequence[TrainSample], step: int) -> list[TrainSample]:
        """Inputs present and finite; ``on_nonfinite="drop"`` leaves out the samples with a
        non-finite input (an empty step still raises)."""
        for s in samples:
            s.require(*self.INPUTS)
        keep = nonfinite_guard(
            step,
            per_sample={"advantage": torch.stack([s.advantage for s in samples])},
            per_token={
                "behave_logp": torch.cat([s.behave_logp for s in samples]),
                "prox_logp": torch.cat([s.prox_logp for s in samples]),
            },
            token_mask=torch.cat([s.loss_mask for s in samples]),
            cu_seqlens=_cu_seqlens([len(s) for s in samples]),
            mode=self.config.on_nonfinite,
        )
        return list(samples) if keep is None else [s for s, k in zip(samples, keep.tolist()) if k]

    def token_fields(self, sample: TrainSample) -> dict[str, tuple[Tensor, float | int | bool]]:
        return {
            "behave_logp": (sample.behave_logp, 0.0),
            "prox_logp": (sample.prox_logp, 0.0),
            "versions": (sample.versions, -1),
            "advantages": (sample.advantage.expand_as(sample.behave_logp).clone(), 0.0),
        }

    def denominator(self, n_tokens: float, n_seqs: float) -> float:
        return n_tokens if self.config.loss_agg == "token-mean" else n_seqs

    def __call__(self, logp, entropy, fields, *, denominator, cu_seqlens, policy_version):
        if cu_seqlens is None and self.needs_whole_sequences:
            raise ValueError(f"{self.whole_sequence_key()}: this loss needs whole sequences (cu_seqlens)")
        loss, stats = decoupled_ppo_loss(
            logp,
            fields["advantages"],
            fields["loss_mask"],
            logp_behave=fields["behave_logp"],
            logp_prox=fields["prox_logp"],
            config=self.config,
            global_denominator=denominator,
            cu_seqlens=cu_seqlens,
            entropy=entropy.detach(),
            versions=fields["versions"],
            policy_version=policy_version,
        )
        return loss, {k: float(v) for k, v in stats.items()}

    def __repr__(self) -> str:
        return f"PPOLoss({self.config!r})"


def _cu_seqlens(lengths: list[int]) -> Tensor:
    return torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
