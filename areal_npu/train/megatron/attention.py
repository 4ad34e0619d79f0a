"""The core attention of the Megatron engine's layer spec: our packed kernel, with context parallelism.

Megatron-Core's own non-Transformer-Engine ``DotProductAttention`` refuses packed (THD) input and
context parallelism, and Transformer Engine does not exist on the CPU or the NPU. This module takes
its place in the layer spec (``SelfAttentionSubmodules.core_attention``), with the same constructor
and forward signature, and computes causal attention inside every packed segment through
:func:`areal_npu.kernels.packed_attention.packed_attention` (``npu_fusion_attention`` TND on the
NPU, flash-attn / torch varlen on CUDA, exact per-segment SDPA on the CPU).

Context parallelism (``cp > 1``), zigzag layout (:mod:`areal_npu.data.context_parallel`): rank ``r``
holds chunks ``r`` and ``2cp-1-r`` of every segment; ``packed_seq_params.cu_seqlens_q_padded`` is the
*global* boundary list (Megatron's convention: RoPE divides it by ``cp`` itself). Keys and values
are all-gathered over the CP group (backward: a reduce-scatter of the gathered gradient), put back
in global order, and each local query at global index ``p`` of segment ``[a, b)`` attends keys
``a .. p``:

    out[t] = sum_{u in [a, p_t]} softmax_u(scale * q_t . k_u) v_u

This all-gather form is exact and runs over gloo; it moves ``T`` tokens of K/V per layer instead of
the ring's overlap of ``T / cp`` per step, so on the NPU MindSpeed's ring attention is the intended
CP path (not wired here; unverified).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from areal_npu.data.context_parallel import cp_gather, zigzag_indices
from areal_npu.kernels.packed_attention import packed_attention

__all__ = ["PackedCoreAttention", "zigzag_causal_attention"]


class _AllGather(torch.autograd.Function):
    """``[t, ...]`` on each rank -> ``[world, t, ...]``; backward: a reduce-scatter (each rank gets
    the sum over ranks of its own part's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # flat along dim 0, as gloo wants it
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        own = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(own, grad.reshape(-1, *grad.shape[2:]).contiguous(), group=ctx.group)
        return own, None


def zigzag_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group,
    scale: float,
) -> torch.Tensor:
    """Causal packed attention of this CP rank's zigzag tokens (see the module docstring).

    ``q`` ``[t, Hq, d]``, ``k``/``v`` ``[t, Hkv, d]`` (``t = T / cp``), ``cu_seqlens`` global, every
    segment a multiple of ``2 * cp``. Returns ``[t, Hq, d]``.
    """
    import torch.nn.functional as F

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = cu_seqlens.to(torch.int64)
    k_full = cp_gather(list(_AllGather.apply(k, group).unbind(0)), cu)
    v_full = cp_gather(list(_AllGather.apply(v, group).unbind(0)), cu)
    positions = zigzag_indices(cu, cp, rank).to(q.device)
    local_cu = (cu // cp).tolist()
    bounds = cu.tolist()
    outs = []
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        la, lb = local_cu[j], local_cu[j + 1]
        if lb == la:
            continue
        keys = torch.arange(a, b, device=q.device)
        mask = keys[None, :] <= positions[la:lb, None]  # [nq, L], True = attend
        qs = q[la:lb].transpose(0, 1).unsqueeze(0)
        ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (k_full, v_full))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


class PackedCoreAttention(torch.nn.Module):
    """Drop-in ``core_attention`` for Megatron's ``SelfAttention``: causal, packed (THD) or bshd.

    A plain ``nn.Module`` (it has no parameters), so importing this file does not import Megatron:
    on the NPU MindSpeed's adaptor must be imported first (:mod:`areal_npu.train.megatron.runtime`)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(f"packed attention is causal only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError("packed attention has no attention dropout; set attention_dropout=0")
        if config.window_size is not None:
            raise NotImplementedError("packed attention has no sliding window")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"packed attention has no {config.softmax_type} softmax")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = getattr(pg_collection, "cp", None)
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            raise NotImplementedError("apply_query_key_layer_scaling is a fp16 trick; not supported")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("packed attention takes no attention bias")
        cp = self.cp_group.size() if self.cp_group is not None else 1
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            if cp > 1:
                return zigzag_causal_attention(query, key, value, cu, self.cp_group, self.softmax_scale)
            return packed_attention(
                query, key, value, cu, max_seqlen=packed_seq_params.max_seqlen_q, scale=self.softmax_scale
            )
        # bshd: [s, b, h, d]; each row is one causal sequence (a padding mask is not supported)
        if attention_mask is not None:
            raise NotImplementedError(
                "packed attention takes no attention mask: pack sequences (THD) instead of padding them"
            )
        if cp > 1:
            raise NotImplementedError("context parallelism needs packed (THD) input")
        s, b = query.shape[:2]
        q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        out = packed_attention(q, k, v, cu, max_seqlen=s, scale=self.softmax_scale)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()
