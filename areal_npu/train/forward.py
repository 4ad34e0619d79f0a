"""What one packed micro-batch computes, and how per-micro-batch stats become step stats.

:class:`PolicyWithMTP` is the single FSDP root of the train engine: the causal LM and its MTP head
together, so the shared embedding and output head are unsharded whenever the forward touches them.
"""

from __future__ import annotations

import torch
from torch import nn

from areal_npu.kernels.logprobs import chunked_logprobs_entropy
from areal_npu.model.mtp_loss import mtp_loss
from areal_npu.train.dist import all_reduce_max, all_reduce_sum


class PolicyWithMTP(nn.Module):
    """One FSDP root holding the HF causal LM and its MTP head, so that the shared embedding and
    output head are unsharded whenever the forward touches them (policy and MTP alike)."""

    def __init__(self, lm: nn.Module, mtp: nn.Module | None):
        super().__init__()
        self.lm = lm
        self.mtp = mtp

    def forward(self, batch: dict, chunk_size: int, temperature: float, mtp_args: dict | None):
        cu = batch["cu_seqlens"]
        kwargs = dict(
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=batch["max_seqlen"],
            max_length_k=batch["max_seqlen"],
            use_cache=False,
        )
        out = self.lm.model(
            input_ids=batch["input_ids"][None], position_ids=batch["position_ids"][None], **kwargs
        )
        hidden = out.last_hidden_state[0]
        head = self.lm.get_output_embeddings().weight
        logp, entropy = chunked_logprobs_entropy(
            hidden, head, batch["targets"], temperature=temperature, chunk_size=chunk_size
        )
        # Outputs must not be views: FSDP2 hooks its pre-backward on them (see its UserWarning).
        logp, entropy = logp.clone(), entropy.clone()
        if mtp_args is None or self.mtp is None:
            return logp, entropy, None, {}
        targets = mtp_args["targets"]
        mtp_hidden = self.mtp(
            hidden,
            targets.embed_ids,
            batch["position_ids"],
            self.lm.get_input_embeddings().weight,
            cu_seqlens=cu,
            max_seqlen=batch["max_seqlen"],
        )
        loss, stats = mtp_loss(
            mtp_hidden, head, targets, mtp_args["loss_scale"], mtp_args["counts"], chunk_size=chunk_size
        )
        return logp, entropy, loss, stats


def shift_left(x: torch.Tensor, fill) -> torch.Tensor:
    """Token-aligned -> prediction-aligned: ``out[t] = x[t + 1]``, ``fill`` at the end."""
    return torch.cat([x[1:], x.new_full((1,), fill)])


def _additive(key: str) -> bool:
    """Stats that are already fractions of a global normaliser: they add up over micro-batches."""
    return key.startswith("mtp/") or key in ("ppo/loss", "ppo/n_valid_tokens")


def merge_stats(per_mb: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Across micro-batches and ranks: sums for additive keys, min / max for ``/min`` / ``/max``
    keys, token-weighted means for the rest."""
    keys = sorted({k for _, s in per_mb for k in s})
    out = {}
    for key in keys:
        vals = [(w, s[key]) for w, s in per_mb if key in s]
        if _additive(key):
            out[key] = all_reduce_sum([sum(v for _, v in vals)])[0]
        elif key.endswith("/min"):
            local = min(v for _, v in vals)
            out[key] = -all_reduce_max([-local])[0]
        elif key.endswith("/max"):
            out[key] = all_reduce_max([max(v for _, v in vals)])[0]
        else:
            num, den = all_reduce_sum([sum(w * v for w, v in vals), sum(w for w, _ in vals)])
            out[key] = num / den if den else 0.0
    return out
