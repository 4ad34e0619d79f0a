"""Run Hugging Face causal LMs on packed (THD) micro-batches.

:func:`enable_packed_attention` registers :func:`hf_packed_attention` with transformers'
``AttentionInterface`` under :data:`ATTN_IMPLEMENTATION` (its mask creation is transformers' FA2 one:
``None`` for causal / packed input, a 2-D padding mask otherwise) and switches the model to it; on
hybrid Qwen3.5 models it also makes the Gated DeltaNet layers restart at segment boundaries, given
either ``cu_seq_lens_q`` or position ids alone (:mod:`areal_npu.compat.transformers`). A packed
micro-batch then runs as a batch of one row:

    model(**packed_forward_kwargs(batch))  # input_ids/position_ids [1, T], cu_seq_lens_q/k, max_length_q/k, use_cache=False

which is the same keyword set transformers' ``DataCollatorWithFlattening`` produces for FA2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_npu.data.packed_layout import PackedBatch, cu_seqlens_from_position_ids
from areal_npu.kernels.packed_attention import packed_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "enable_packed_attention",
    "hf_packed_attention",
    "packed_forward_kwargs",
    "packed_shift_labels",
    "packed_token_logprobs",
    "register_packed_attention",
]

ATTN_IMPLEMENTATION = "areal_packed"


def hf_packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` ``[B, Hq, S, d]``, ``key``/``value`` ``[B, Hkv, S, d]``
    -> ``([B, S, Hq, d], None)``.

    Segments come from ``cu_seq_lens_q`` when given, else from ``position_ids`` restarting at 0
    (batch of one row), else each row is one sequence; a 2-D padding mask removes padded tokens
    first (flash-attention style unpadding). Training and full prefill only: no KV cache. A sliding
    window is accepted when it covers every segment (then it is causal attention), else refused.
    """
    if dropout:
        raise NotImplementedError("packed attention has no attention dropout; set attention_dropout=0")
    if softcap is not None:
        raise NotImplementedError("packed attention has no logit softcapping")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise NotImplementedError("packed attention is causal only")
    batch, _, seq, _ = query.shape
    if key.shape[2] != seq:
        raise NotImplementedError(
            "packed attention is for training / full prefill (query and key lengths differ)"
        )
    q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[3]) for x in (query, key, value))
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    keep = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"packed attention takes a 2-D padding mask, got shape {tuple(attention_mask.shape)}"
            )
        keep = attention_mask.reshape(-1).bool().nonzero().view(-1)
        counts = attention_mask.bool().sum(-1).to(torch.int32)
        cu = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
        q, k, v = q[keep], k[keep], v[keep]
    elif cu is None and position_ids is not None and batch == 1:
        cu = cu_seqlens_from_position_ids(position_ids.reshape(-1)[-seq:])
    elif cu is None:
        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device)
    elif batch != 1:
        raise ValueError(f"cu_seq_lens_q needs the packed batch as one row, got batch size {batch}")
    if sliding_window is not None:
        _check_window_covers_segments(sliding_window, cu, kwargs.get("max_length_q"))
    out = packed_attention(q, k, v, cu.to(q.device), max_seqlen=kwargs.get("max_length_q"), scale=scaling)
    if keep is not None:
        full = out.new_zeros(batch * seq, *out.shape[1:])
        full[keep] = out
        out = full
    return out.reshape(batch, seq, *out.shape[1:]), None


def _check_window_covers_segments(window: int, cu: torch.Tensor, max_length: int | None) -> None:
    """Accept a sliding window only where it changes nothing.

    transformers' window (``masking_utils.sliding_window_overlay``) lets query ``q`` see key ``k``
    when ``q - k < window``, i.e. ``window`` tokens including itself (flash-attention's
    ``window_size=(window - 1, ...)``). In a segment of length ``L`` the largest distance is
    ``L - 1``, so the window is plain causal attention exactly when ``L <= window``.
    """
    if max_length is not None and max_length <= window:
        return  # max_length_q bounds every segment: no host sync needed
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    if longest > window:
        raise NotImplementedError(
            f"packed attention has no sliding window: sliding_window={window} is shorter than the "
            f"longest packed segment ({longest} tokens), so the window would mask keys; pack sequences "
            f"of at most {window} tokens or use an attention implementation with windows"
        )


def register_packed_attention() -> str:
    """Register the attention function and its mask rule; returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, flash_attention_mask)
    return ATTN_IMPLEMENTATION


def enable_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` (any HF causal LM) to packed attention, and make linear-attention layers
    (Qwen3.5 Gated DeltaNet) restart their conv and recurrent state at every segment boundary."""
    from areal_npu.compat.transformers import patch_linear_attention_for_packing, segment_by_position_ids

    register_packed_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    patch_linear_attention_for_packing()
    segment_by_position_ids(model, cu_seqlens_from_position_ids)
    return model


def packed_forward_kwargs(batch: PackedBatch) -> dict[str, torch.Tensor | int]:
    """Model keyword arguments for one packed micro-batch (batch dimension 1, no attention mask)."""
    cu = batch.cu_seqlens.to(torch.int32)
    return {
        "input_ids": batch.input_ids.unsqueeze(0),
        "position_ids": batch.position_ids.unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": batch.max_seqlen,
        "max_length_k": batch.max_seqlen,
        "use_cache": False,
    }


def packed_shift_labels(
    labels: torch.Tensor, cu_seqlens: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Next-token targets that never cross a segment: ``out[t] = labels[t + 1]`` inside a segment,
    ``ignore_index`` at each segment's last token. Pass as ``shift_labels=`` to an HF causal LM."""
    out = torch.full_like(labels, ignore_index)
    out[..., :-1] = labels[..., 1:]
    ends = cu_seqlens[1:].to(torch.int64) - 1
    out[..., ends] = ignore_index
    return out


def packed_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """``logp[t] = log_softmax(logits[t])[ids[t + 1]]`` within each segment, 0 at segment ends.

    ``logits`` ``[T, V]``, ``input_ids`` ``[T]``; fp32 log-softmax.
    """
    targets = packed_shift_labels(input_ids, cu_seqlens, ignore_index=-1)
    valid = targets >= 0
    logp = (
        torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    )
    return logp * valid
