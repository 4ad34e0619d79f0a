"""Qwen3.5 / 3.6's Gated DeltaNet, tensor-parallel over heads, for the Megatron engine.

The engine's ``linear_attention`` layers (:mod:`.hybrid`). Megatron-Core 0.16.1's own
``GatedDeltaNet`` refuses packed sequences and needs FLA's Triton kernels. This one is transformers'
``Qwen3_5GatedDeltaNet`` (the torch path the FSDP2 engine trains on the CPU, made exact on packed
rows by :func:`areal_npu.compat.transformers.patch_linear_attention_for_packing`: one call per
segment) holding this rank's heads; on the NPU in bf16/fp16 the same weights run over the whole
packed row through MindSpeed's varlen gated delta rule (:mod:`.npu_fused`).

The layer (``Hk`` key heads of dim ``dk``, ``Hv`` value heads of dim ``dv``, value head ``j`` reads
key head ``j // (Hv / Hk)``) has four input projections -- ``in_proj_qkv`` rows ``[q (Hk dk); k
(Hk dk); v (Hv dv)]``, ``in_proj_z`` (``Hv dv``), ``in_proj_b`` / ``in_proj_a`` (``Hv``) -- a
depthwise ``conv1d`` over the ``q; k; v`` channels, per-value-head ``A_log`` / ``dt_bias``, a gated
RMSNorm over each head's ``dv`` values and ``out_proj`` (``Hv dv`` columns). Every op between the
projections and ``out_proj`` is per head, so TP rank ``r`` of ``tp`` takes key heads
``r Hk/tp ..`` and value heads ``r Hv/tp ..`` (the same key/value pairing: ``Hk`` divisible by
``tp``): the matching rows of the projections, channels of ``conv1d``, entries of ``A_log`` /
``dt_bias`` and columns of ``out_proj`` (row-parallel: the outputs are summed over TP). The gated
norm's weight is shared by every head: each rank holds all of it and its gradient is a partial sum
over TP (as the per-head q/k norms of attention, :data:`TP_PARTIAL`).

Sequence and context parallelism (:class:`ParallelGatedDeltaNet`): the recurrence needs the whole
sequence, so the layer gathers the row from the ranks' shares, the CP ranks split the TP rank's heads
once more (the same slicing, applied to the weights inside the forward), and the output is summed
back onto the shares.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from areal_npu.data.context_parallel import cp_gather, cp_split
from areal_npu.train.megatron.npu_fused import gdn_rule, packed_gdn_forward

__all__ = ["TP_PARTIAL", "ParallelGatedDeltaNet", "check_gdn_tp", "shard_gdn", "unshard_gdn"]

#: Replicated weights whose gradient is partial over TP ranks.
TP_PARTIAL = ("norm.weight",)


def _dims(cfg) -> tuple[int, int, int, int]:
    return cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim


def check_gdn_tp(cfg, tp_size: int, cp_size: int = 1) -> None:
    """``ValueError`` naming the sizes when the heads do not split over ``tp_size`` x ``cp_size`` ranks."""
    hk, _, hv, _ = _dims(cfg)
    if hk % (tp_size * cp_size) or hv % (tp_size * cp_size):
        ranks = f"tp_size={tp_size}" + (f" x cp_size={cp_size}" if cp_size > 1 else "")
        raise ValueError(
            f"linear_num_key_heads={hk} and linear_num_value_heads={hv} must both be divisible by "
            f"{ranks} (the Gated DeltaNet is split over TP and CP ranks by heads)"
        )


def _heads(cfg, ranks: int):
    """``cfg`` with ``1/ranks`` of the linear key and value heads."""
    local = copy.copy(cfg)
    local.linear_num_key_heads = cfg.linear_num_key_heads // ranks
    local.linear_num_value_heads = cfg.linear_num_value_heads // ranks
    return local


def _slices(cfg, tp_rank: int, tp_size: int) -> dict[str, list[slice]]:
    """Per HF tensor (relative to ``linear_attn.``): the row / entry slices this rank holds, in order."""
    hk, dk, hv, dv = _dims(cfg)
    k0, k1 = tp_rank * hk // tp_size * dk, (tp_rank + 1) * hk // tp_size * dk
    v0, v1 = tp_rank * hv // tp_size, (tp_rank + 1) * hv // tp_size
    key = hk * dk
    qkv = [slice(k0, k1), slice(key + k0, key + k1), slice(2 * key + v0 * dv, 2 * key + v1 * dv)]
    return {
        "in_proj_qkv.weight": qkv,
        "conv1d.weight": qkv,
        "in_proj_z.weight": [slice(v0 * dv, v1 * dv)],
        "in_proj_b.weight": [slice(v0, v1)],
        "in_proj_a.weight": [slice(v0, v1)],
        "A_log": [slice(v0, v1)],
        "dt_bias": [slice(v0, v1)],
    }


def shard_gdn(state: Mapping[str, torch.Tensor], cfg, tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This rank's tensors of one layer from its full HF tensors (names relative to ``linear_attn.``)."""
    check_gdn_tp(cfg, tp_size)
    out = {}
    slices = _slices(cfg, tp_rank, tp_size)
    for name, tensor in state.items():
        if name in slices:
            out[name] = torch.cat([tensor[s] for s in slices[name]]).contiguous()
        elif name == "out_proj.weight":
            out[name] = tensor.chunk(tp_size, dim=1)[tp_rank].contiguous()  # columns = value heads
        elif name in TP_PARTIAL:
            out[name] = tensor
        else:
            raise KeyError(f"unknown Gated DeltaNet tensor {name!r}")
    return out


def unshard_gdn(shards: Sequence[Mapping[str, torch.Tensor]], cfg) -> dict[str, torch.Tensor]:
    """The full HF tensors of one layer from every TP rank's :func:`shard_gdn` (in rank order)."""
    tp = len(shards)
    out = {}
    for name in shards[0]:
        if name == "out_proj.weight":
            out[name] = torch.cat([s[name] for s in shards], dim=1)
        elif name in TP_PARTIAL:
            out[name] = shards[0][name]
        else:  # the rank's parts, in its slice order, back to their places
            parts = [_slices(cfg, r, tp)[name] for r in range(tp)]
            full_len = max(sl.stop for p in parts for sl in p)
            full = shards[0][name].new_empty((full_len, *shards[0][name].shape[1:]))
            for rank_slices, shard in zip(parts, (s[name] for s in shards)):
                offset = 0
                for sl in rank_slices:
                    n = sl.stop - sl.start
                    full[sl] = shard[offset : offset + n]
                    offset += n
            out[name] = full
    return out


class _SumToShare(torch.autograd.Function):
    """``[T, ...]`` partial on each CP rank -> this rank's zigzag share of the sum over the group:
    the rows put in rank order (every rank's share one after the other), then a reduce-scatter;
    backward: an all-gather of the shares' gradients, put back in row order (each rank's partial
    output reaches every share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cu_seqlens: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        cp = dist.get_world_size(group)
        ctx.cu, ctx.group = cu_seqlens, group
        by_rank = torch.cat([cp_split(x, cu_seqlens, cp, r) for r in range(cp)]).contiguous()
        share = x.new_empty((x.shape[0] // cp, *x.shape[1:]))
        dist.reduce_scatter_tensor(share, by_rank, group=group)
        return share

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        cp = dist.get_world_size(ctx.group)
        gathered = grad.new_empty((cp * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_into_tensor(gathered, grad.contiguous(), group=ctx.group)
        return cp_gather(list(gathered.chunk(cp)), ctx.cu), None, None


class ParallelGatedDeltaNet(torch.nn.Module):
    """One Gated DeltaNet layer holding this TP rank's heads: ``forward(hidden [t, H], cu_seqlens)``
    returns the layer's output ``[t, H]`` for the same tokens, summed over the heads of every rank.
    Segments never see each other; ``cu_seqlens`` are the packed row's global boundaries.

    ``hidden`` is the whole row (the same on every TP rank), or with ``sequence_parallel`` this TP
    rank's contiguous share of it, or with ``cp_size > 1`` this CP rank's zigzag share
    (:mod:`areal_npu.data.context_parallel`) of it. The recurrence runs along the whole sequence, so
    the shares are gathered into the row first -- over TP (Megatron's sequence-parallel all-gather),
    then over CP -- and the output is summed back onto them (reduce-scatter). The CP ranks of one TP
    rank hold the same weights (Megatron's CP replicates parameters) but each computes its ``1/cp`` of
    the heads, sliced from them as TP slices the checkpoint (:func:`shard_gdn`): no compute is
    repeated, and a weight's gradient arrives from the rank that used it when the engine sums
    gradients over the data- and context-parallel ranks."""

    def __init__(
        self,
        text_config,
        layer_idx: int,
        tp_size: int = 1,
        tp_group=None,
        dtype=torch.float32,
        *,
        sequence_parallel: bool = False,
        cp_size: int = 1,
        cp_group=None,
    ):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        from areal_npu.compat.transformers import patch_linear_attention_for_packing
        from areal_npu.train.megatron.runtime import import_megatron

        import_megatron()  # its collectives below (MindSpeed first on the NPU, the CPU shims here)
        check_gdn_tp(text_config, tp_size, cp_size)
        patch_linear_attention_for_packing()
        self.inner = Qwen3_5GatedDeltaNet(_heads(text_config, tp_size), layer_idx).to(dtype)  # this TP rank's
        self.tp_size, self.tp_group, self.sequence_parallel = tp_size, tp_group, sequence_parallel and tp_size > 1
        self.cp_size, self.cp_group = cp_size, cp_group
        if cp_size > 1:  # the function of this CP rank's heads; weights come from ``inner`` (not registered)
            self._tp_config = _heads(text_config, tp_size)
            with torch.device("meta"):
                self.__dict__["_cp_layer"] = Qwen3_5GatedDeltaNet(_heads(text_config, tp_size * cp_size), layer_idx)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.sequence_parallel:  # backward: reduce-scatter of the heads' partial input gradients
            hidden = mappings.gather_from_sequence_parallel_region(hidden, True, group=self.tp_group)
        elif self.tp_size > 1:
            hidden = mappings.copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)  # backward: sum
        cu = cu_seqlens.to(device=hidden.device, dtype=torch.int32)
        rule = gdn_rule(hidden)  # MindSpeed's packed kernel on the NPU (bf16/fp16), else None
        if self.cp_size > 1:
            import torch.distributed as dist

            from areal_npu.train.megatron.attention import _AllGather

            hidden = cp_gather(list(_AllGather.apply(hidden, self.cp_group).unbind(0)), cu.long())
            rank = dist.get_rank(self.cp_group)
            weights = shard_gdn(dict(self.inner.named_parameters()), self._tp_config, rank, self.cp_size)
            if rule is not None:
                out = packed_gdn_forward(self._cp_layer, hidden[None], cu, rule, weights)[0]
            else:
                out = torch.func.functional_call(
                    self._cp_layer, weights, (hidden[None],), {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
                )[0]
            out = _SumToShare.apply(out, cu.long(), self.cp_group)
        elif rule is not None:
            out = packed_gdn_forward(self.inner, hidden[None], cu, rule)[0]
        else:
            out = self.inner(hidden[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0]
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        if self.tp_size > 1:
            return mappings.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out
