"""Qwen3.5 / 3.6's Gated DeltaNet, tensor-parallel over heads, for the Megatron engine.

The engine's ``linear_attention`` layers (:mod:`.hybrid`). Megatron-Core 0.16.1's own
``GatedDeltaNet`` refuses packed sequences and needs FLA's Triton kernels; on the NPU MindSpeed
carries a fused one (not wired). This one is transformers' ``Qwen3_5GatedDeltaNet`` (the torch path the FSDP2 engine
trains on the CPU and on Ascend, made exact on packed rows by
:func:`areal_npu.compat.transformers.patch_linear_attention_for_packing`) holding this rank's heads.

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
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

__all__ = ["TP_PARTIAL", "ParallelGatedDeltaNet", "check_gdn_tp", "shard_gdn", "unshard_gdn"]

#: Replicated weights whose gradient is partial over TP ranks.
TP_PARTIAL = ("norm.weight",)


def _dims(cfg) -> tuple[int, int, int, int]:
    return cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim


def check_gdn_tp(cfg, tp_size: int) -> None:
    """``ValueError`` naming the size when the heads do not split over ``tp_size`` ranks."""
    hk, _, hv, _ = _dims(cfg)
    if hk % tp_size or hv % tp_size:
        raise ValueError(
            f"linear_num_key_heads={hk} and linear_num_value_heads={hv} must both be divisible by "
            f"tp_size={tp_size} (the Gated DeltaNet is split over TP by heads)"
        )


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


class ParallelGatedDeltaNet(torch.nn.Module):
    """One Gated DeltaNet layer holding this TP rank's heads: ``forward(hidden [t, H], cu_seqlens)``
    on one packed row (the same on every rank of ``tp_group``) returns the layer's output ``[t, H]``,
    summed over the group. Segments never see each other."""

    def __init__(self, text_config, layer_idx: int, tp_size: int = 1, tp_group=None, dtype=torch.float32):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        from areal_npu.compat.transformers import patch_linear_attention_for_packing

        check_gdn_tp(text_config, tp_size)
        patch_linear_attention_for_packing()
        local = copy.copy(text_config)  # this rank's heads
        local.linear_num_key_heads = text_config.linear_num_key_heads // tp_size
        local.linear_num_value_heads = text_config.linear_num_value_heads // tp_size
        self.inner = Qwen3_5GatedDeltaNet(local, layer_idx).to(dtype)
        self.tp_size, self.tp_group = tp_size, tp_group

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)  # backward: sum
        cu = cu_seqlens.to(device=hidden.device, dtype=torch.int32)
        out = self.inner(hidden[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0]
        if self.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out
