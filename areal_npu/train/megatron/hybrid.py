"""Qwen3.5 / 3.6 dense hybrids in the Megatron engine: Gated DeltaNet layers beside gated full attention.

Per decoder layer (``layer_types`` of the text config):

- ``full_attention``: the engine's local layer spec (packed core attention) with Megatron's
  ``attention_output_gate`` (Qwen3.5's ``q_proj`` yields a query and an output gate per head,
  ``attn * sigmoid(gate)``), partial RoPE (``rotary_percent`` = ``partial_rotary_factor``) and
  zero-centred q/k norms.
- ``linear_attention``: a ``TransformerLayer`` whose self-attention slot is
  :class:`GatedDeltaNetAttention` -- :class:`areal_npu.train.megatron.gdn.ParallelGatedDeltaNet` on
  the packed row's segments (``PackedSeqParams.cu_seqlens_q``), its heads split over TP.

Every RMSNorm of Qwen3.5 is zero-centred (``(1 + w) x / rms(x)``); Megatron's plain RMSNorm holds
``1 + w`` (the conversion's ``zc`` kinds, :mod:`.convert`), exact in the forward and the gradient.
On text, Qwen3.5's multimodal rotary sections all see the one position of a token, which is plain
RoPE over the rotary dims. MoE variants (``qwen3_5_moe``) are not mapped.

Parallelism: TP splits the Gated DeltaNet's heads, pipeline stages split the layers. Sequence and
context parallelism hand the layer a share of the row, while its recurrence runs along the whole
sequence: the layer gathers the row (over TP, then CP), each TP x CP rank computes its
``1 / (tp cp)`` of the heads on it, and the output is summed back onto the shares
(:class:`areal_npu.train.megatron.gdn.ParallelGatedDeltaNet`). That moves the row's hidden states
(``T x H``) through each such layer, as attention's all-gather CP moves keys and values. The linear key
and value heads must divide by ``tp x cp``; :func:`check_hybrid_layout` refuses other sizes with
a sentence.
"""

from __future__ import annotations

import torch

from areal_npu.train.megatron.shape import GPTShape, text_config
from areal_npu.train.megatron.specs import layer_spec

__all__ = ["GatedDeltaNetAttention", "check_hybrid_layout", "hybrid_layer_specs"]


def check_hybrid_layout(shape: GPTShape, tp_size: int, cp_size: int = 1, sequence_parallel: bool = False) -> None:
    """``ValueError`` naming the sizes a Qwen3.5 hybrid's Gated DeltaNet heads do not split over
    (``sequence_parallel`` needs nothing more: the layer gathers its TP group's shares)."""
    if not shape.hybrid:
        return
    hk, _, hv, _, _ = shape.linear_dims
    if hk % (tp_size * cp_size) or hv % (tp_size * cp_size):
        ranks = f"tp_size={tp_size}" + (f" x cp_size={cp_size}" if cp_size > 1 else "")
        raise ValueError(
            f"linear_num_key_heads={hk} and linear_num_value_heads={hv} must be divisible by {ranks} "
            "(each TP x CP rank computes its share of the Gated DeltaNet heads)"
        )


class GatedDeltaNetAttention(torch.nn.Module):
    """The self-attention slot of a ``linear_attention`` layer: ``forward(hidden [t, 1, H], ...,
    packed_seq_params)`` returns ``(output [t, 1, H], None)`` as Megatron's ``SelfAttention`` does."""

    def __init__(self, config, layer_number: int, text_config=None, **_megatron_kwargs):
        super().__init__()
        from megatron.core import parallel_state as ps

        from areal_npu.train.megatron.gdn import ParallelGatedDeltaNet

        tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
        self.gdn = ParallelGatedDeltaNet(
            text_config,
            layer_number - 1,
            tp,
            ps.get_tensor_model_parallel_group() if tp > 1 else None,
            dtype=config.params_dtype,
            sequence_parallel=config.sequence_parallel,
            cp_size=cp,
            cp_group=ps.get_context_parallel_group() if cp > 1 else None,
        )

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_unused):
        if packed_seq_params is None:  # one sequence (bshd, b = 1), the whole of it on every rank
            cu = torch.tensor([0, hidden_states.shape[0] * (self.gdn.tp_size if self.gdn.sequence_parallel else 1)])
        else:
            cu = packed_seq_params.cu_seqlens_q  # global boundaries
        return self.gdn(hidden_states[:, 0], cu)[:, None], None


def hybrid_layer_specs(hf_config, shape: GPTShape, layers: range) -> list:
    """Megatron layer specs of the global decoder layers ``layers`` (one pipeline stage's)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    text = text_config(hf_config)
    specs = []
    for i in layers:
        spec = layer_spec()
        if shape.layer_types[i] == "linear_attention":
            spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNetAttention, params={"text_config": text})
        specs.append(spec)
    return specs
