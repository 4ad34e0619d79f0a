"""What one packed micro-batch holds and computes.

:func:`prediction_fields` (both engines): a micro-batch's samples shifted to prediction alignment and
packed. :class:`MTPArgs` (both engines): what the MTP head's loss takes for one micro-batch.
:class:`MicroBatch` and :class:`PolicyWithMTP` (the FSDP2 engine): the batch on the device, and the
single FSDP root holding the causal LM and its MTP head together, so the shared embedding and output
head are unsharded whenever the forward touches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from areal_npu import names
from areal_npu.data.packed_layout import PackedBatch, pack_per_token
from areal_npu.data.sample import TrainSample
from areal_npu.kernels.logprobs import chunked_logprobs_entropy
from areal_npu.model.eagle3 import capture_aux_states
from areal_npu.model.mtp_loss import mtp_loss
from areal_npu.model.mtp_targets import MTPTargets
from areal_npu.train.losses import Loss

#: the target of positions that predict nothing (a segment's last token, padding)
IGNORE = -100


@dataclass
class MTPArgs:
    """The MTP head's loss arguments for one micro-batch: its targets (on the device), the weight
    of the head's loss (``mtp.loss_scale``) and the global per-depth counts of target tokens, summed
    over micro-batches and data-parallel ranks, so the micro-batches' losses add up to the step's."""

    targets: MTPTargets
    loss_scale: float
    counts: list[int] | None = None  # None: this micro-batch's own counts


class PolicyWithMTP(nn.Module):
    """One FSDP root holding the HF causal LM, its MTP head and the EAGLE-3 drafter (each optional),
    so that the shared embedding and output head are unsharded whenever the forward touches them.

    The EAGLE-3 drafter (:class:`areal_npu.model.eagle3.Eagle3Drafter`) reads the policy's residual
    stream at its auxiliary layers, recorded during the policy's own forward (no second pass) and
    used detached; its loss is added to the MTP loss (stats under ``eagle3/``)."""

    def __init__(self, lm: nn.Module, mtp: nn.Module | None, eagle3: nn.Module | None = None):
        super().__init__()
        self.lm = lm
        self.mtp = mtp
        self.eagle3 = eagle3

    def forward(
        self,
        batch: MicroBatch,
        chunk_size: int,
        temperature: float,
        mtp_args: MTPArgs | None,
        eagle3_args: MTPArgs | None = None,
    ):
        cu = batch.cu_seqlens
        kwargs = dict(
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=batch.max_seqlen,
            max_length_k=batch.max_seqlen,
            use_cache=False,
        )
        eagle3 = self.eagle3 if eagle3_args is not None else None
        layers = eagle3.aux_layers if eagle3 is not None else []
        with capture_aux_states(self.lm.model, layers) as aux:
            out = self.lm.model(
                input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], **kwargs
            )
        hidden = out.last_hidden_state[0]
        head = self.lm.get_output_embeddings().weight
        logp, entropy = chunked_logprobs_entropy(
            hidden, head, batch.fields["targets"], temperature=temperature, chunk_size=chunk_size
        )
        # Outputs must not be views: FSDP2 hooks its pre-backward on them (see its UserWarning).
        logp, entropy = logp.clone(), entropy.clone()
        loss, stats = None, {}
        embed = self.lm.get_input_embeddings().weight
        if mtp_args is not None and self.mtp is not None:
            targets = mtp_args.targets
            mtp_hidden = self.mtp(
                hidden,
                targets.embed_ids,
                batch.position_ids,
                embed,
                cu_seqlens=cu,
                max_seqlen=batch.max_seqlen,
            )
            loss, stats = mtp_loss(
                mtp_hidden, head, targets, mtp_args.loss_scale, mtp_args.counts, chunk_size=chunk_size
            )
        if eagle3 is not None:
            targets = eagle3_args.targets
            drafted = eagle3(
                [aux[i][0] for i in layers],
                targets.embed_ids,
                batch.position_ids,
                embed,
                cu,
                batch.max_seqlen,
            )
            e_loss, e_stats = mtp_loss(
                drafted, head, targets, eagle3_args.loss_scale, eagle3_args.counts, chunk_size=chunk_size
            )
            stats.update(names.as_eagle3_stats(e_stats))
            loss = e_loss if loss is None else loss + e_loss
        return logp, entropy, loss, stats


def shift_left(x: torch.Tensor, fill) -> torch.Tensor:
    """Token-aligned -> prediction-aligned: ``out[t] = x[t + 1]``, ``fill`` at the end."""
    return torch.cat([x[1:], x.new_full((1,), fill)])


def prediction_fields(seqs: Sequence[TrainSample], packed: PackedBatch, loss: Loss | None) -> dict[str, torch.Tensor]:
    """The packed, prediction-aligned per-token tensors of one micro-batch (host side):
    ``targets`` (the next token, :data:`IGNORE` at each segment's end and on padding), and with a
    ``loss`` its ``loss_mask`` and :meth:`areal_npu.train.losses.Loss.token_fields`. Each sequence is
    shifted before packing, so no target crosses a segment boundary."""
    out = {"targets": pack_per_token([shift_left(s.input_ids, IGNORE) for s in seqs], packed, IGNORE)}
    if loss is None:
        return out
    columns: dict[str, list[torch.Tensor]] = {"loss_mask": [s.loss_mask for s in seqs]}
    pads: dict[str, object] = {"loss_mask": False}
    for s in seqs:
        for name, (tensor, pad) in loss.token_fields(s).items():
            columns.setdefault(name, []).append(tensor)
            pads[name] = pad
    for name, tensors in columns.items():
        out[name] = pack_per_token([shift_left(t, pads[name]) for t in tensors], packed, pads[name])
    return out


@dataclass
class MicroBatch:
    """One packed micro-batch on the device (FSDP2 engine): the THD row and its prediction-aligned
    per-token ``fields`` (``targets``, ``loss_mask``, the loss's fields)."""

    packed: PackedBatch  # the host-side layout: cu_seqlens, sample indices, padding
    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T] restarting at 0 in every segment
    cu_seqlens: torch.Tensor  # [S + 1]
    max_seqlen: int
    fields: dict[str, torch.Tensor]  # [T] each

    @classmethod
    def on(cls, packed: PackedBatch, fields: dict[str, torch.Tensor], device) -> MicroBatch:
        return cls(
            packed=packed,
            input_ids=packed.input_ids.to(device),
            position_ids=packed.position_ids.to(device),
            cu_seqlens=packed.cu_seqlens.to(device),
            max_seqlen=packed.max_seqlen,
            fields={k: v.to(device) for k, v in fields.items()},
        )
