"""The MTP auxiliary loss and a joint backbone + MTP forward for HF causal LMs.

Loss over depths d = 1..D, with ``N_d`` the tokens carrying loss at depth d:

    CE_d   = sum_{t: mask_d[t]} -log softmax(W h_t^(d))[labels_d[t]]
    loss_d = CE_d / N_d,        acc_d = #{argmax W h_t^(d) == labels_d[t]} / N_d
    L_mtp  = loss_scale / D * sum_d loss_d

``N_d`` defaults to this micro-batch's count. For consistent normalisation across micro-batches
(and data-parallel ranks) pass the global per-depth counts (the sum of
:meth:`MTPTargets.valid_counts`): then ``L_mtp``, ``mtp/loss_d{d}`` and ``mtp/acc_d{d}`` of the
micro-batches *add up* to the global values, exactly as a token-mean policy loss does.

Memory: the head runs through the chunked log-prob kernel
(:func:`areal_npu.kernels.logprobs.chunked_logprobs_hits`), so no ``[tokens, vocab]`` logits exist:
at most two ``[chunk_size, vocab]`` float32 buffers per depth at a time (64K tokens x 248K vocab in
full would be 63 GB per depth). Logits are accumulated in float32 even for bf16 inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from areal_npu import names
from areal_npu.kernels.logprobs import DEFAULT_CHUNK_SIZE, chunked_logprobs_hits
from areal_npu.model.mtp import MTPConfig, Qwen35MTP
from areal_npu.model.mtp_targets import MTPTargets

__all__ = ["JointOutput", "backbone_forward", "joint_forward", "mtp_loss"]


def mtp_loss(
    mtp_hidden: Sequence[torch.Tensor],
    output_weight: torch.Tensor,
    targets: MTPTargets,
    loss_scale: float = MTPConfig.loss_scale,
    num_valid_tokens: int | Sequence[int] | None = None,
    ignore_index: int = -100,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(L_mtp, stats)`` with ``stats["mtp/loss_d{d}"]`` (unscaled) and ``stats["mtp/acc_d{d}"]``.

    ``mtp_hidden[d-1]`` is depth d's post-norm hidden state shaped like ``targets.labels[d-1]`` plus
    a hidden dim; ``output_weight`` is the shared head, used detached. ``num_valid_tokens``: one
    global count per depth (or one int for all depths); default the local counts. ``chunk_size``:
    tokens per chunk of the head's logits (peak extra memory ~ 2 x chunk_size x vocab x 4 bytes).
    """
    depths = len(mtp_hidden)
    if depths > targets.num_depths:
        raise ValueError(f"{depths} MTP depths but targets for {targets.num_depths}")
    if num_valid_tokens is None:
        counts = targets.valid_counts()[:depths]
    elif isinstance(num_valid_tokens, int):
        counts = [num_valid_tokens] * depths
    else:
        counts = list(num_valid_tokens)[:depths]
        if len(counts) != depths:
            raise ValueError(f"num_valid_tokens has {len(counts)} entries for {depths} depths")
    total = None
    stats: dict[str, float] = {}
    for d, hidden in enumerate(mtp_hidden, start=1):
        labels = targets.labels[d - 1].reshape(-1).to(hidden.device)
        if hidden.shape[:-1].numel() != labels.numel():
            raise ValueError(
                f"mtp_hidden[{d - 1}] has shape {tuple(hidden.shape)}, labels {tuple(targets.labels[d - 1].shape)}"
            )
        keep = (labels != ignore_index).nonzero().view(-1)
        # Only rows that carry loss go through the (vocabulary-sized) head, chunk by chunk; the head
        # is detached, so the kernel computes no weight gradient (isolation of the output head).
        logp, hits = chunked_logprobs_hits(
            hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep),
            output_weight.detach(),
            labels.index_select(0, keep),
            chunk_size=chunk_size,
        )
        ce = -logp.sum()
        denom = max(int(counts[d - 1]), 1)
        loss_d = ce / denom
        correct = hits.sum()
        stats[names.mtp_loss_key(d)] = float(loss_d.detach())
        stats[names.mtp_acc_key(d)] = float(correct) / denom
        stats[names.mtp_count_key(d)] = float(keep.numel())
        total = loss_d if total is None else total + loss_d
    loss = total * (loss_scale / depths)
    stats[names.MTP_LOSS] = float(loss.detach())
    return loss, stats


def backbone_forward(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, last_hidden_state)`` of an HF causal LM (``model.model`` + ``lm_head``); the
    hidden state is post final norm, what vLLM hands its MTP drafter."""
    out = model.model(**inputs)
    hidden = out.last_hidden_state
    return model.lm_head(hidden), hidden


@dataclass
class JointOutput:
    logits: torch.Tensor
    hidden: torch.Tensor
    mtp_hidden: list[torch.Tensor]
    mtp_loss: torch.Tensor | None
    stats: dict[str, float] = field(default_factory=dict)


def joint_forward(
    model,
    mtp: Qwen35MTP,
    targets: MTPTargets,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    loss_scale: float = MTPConfig.loss_scale,
    num_valid_tokens: int | Sequence[int] | None = None,
    freeze_backbone: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    **model_kwargs,
) -> JointOutput:
    """Backbone forward (logits for the policy/SFT loss) + all MTP depths + the MTP loss.

    Packed input: ``input_ids`` / ``position_ids`` ``[1, T]`` (or ``[T]``) with ``cu_seqlens``;
    the backbone gets the packed-attention keywords (:func:`areal_npu.model.packed.packed_forward_kwargs`
    set). ``freeze_backbone`` runs the backbone without autograd (MTP-only training).
    """
    if input_ids.dim() == 1:
        input_ids, position_ids = input_ids.unsqueeze(0), position_ids.unsqueeze(0)
    kwargs = dict(model_kwargs)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max())
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_seqlen, max_length_k=max_seqlen)
    kwargs.setdefault("use_cache", False)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not freeze_backbone):
        logits, hidden = backbone_forward(model, input_ids=input_ids, position_ids=position_ids, **kwargs)
    embed_ids = targets.embed_ids
    if cu_seqlens is not None:  # packed targets are [D, T]; the row here is [1, T]
        embed_ids = embed_ids.reshape(embed_ids.shape[0], *input_ids.shape)
    mtp_hidden = mtp(
        hidden,
        embed_ids,
        position_ids,
        model.get_input_embeddings().weight,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    loss, stats = mtp_loss(
        mtp_hidden,
        model.get_output_embeddings().weight,
        targets,
        loss_scale,
        num_valid_tokens,
        chunk_size=chunk_size,
    )
    return JointOutput(logits, hidden, mtp_hidden, loss, stats)
