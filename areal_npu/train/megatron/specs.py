"""The engine's local Megatron layer spec: Megatron's own linear layers with our packed core
attention (:class:`areal_npu.train.megatron.attention.PackedCoreAttention`) and torch RMSNorms (on
the NPU: MindSpeed's fused RMSNorm and SwiGLU kernels, :mod:`.npu_fused`).

Shared by the decoder (:mod:`.model`), the Qwen3.5 hybrid layers (:mod:`.hybrid`) and the MTP layer
(:mod:`.mtp`); it sits below all three.
"""

from __future__ import annotations

import torch

from areal_npu.train.megatron.npu_fused import FusedRMSNorm, FusedSwiGLU, fused_kernels
from areal_npu.train.megatron.runtime import import_megatron

__all__ = ["TorchRMSNorm", "layer_spec"]


class TorchRMSNorm:
    """Megatron's ``WrappedTorchNorm`` (``torch.nn.RMSNorm``) minus its refusal of sequence
    parallelism. The refusal is about gradients, not the maths: under sequence parallelism a norm
    sees only its rank's share of the tokens, so its weight gradient is a partial sum over TP.
    Megatron marks such weights ``sequence_parallel`` and all-reduces them in
    ``finalize_model_grads``; this norm marks them the same way and the engine all-reduces them."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise NotImplementedError("TorchRMSNorm is a plain RMSNorm (no zero-centred gamma)")
        # in the compute dtype, as every Megatron layer's params_dtype (bf16: fp32 masters elsewhere)
        if fused_kernels():  # MindSpeed's fused RMSNorm kernel, the same weight
            return FusedRMSNorm(hidden_size, eps, config.params_dtype, bool(config.sequence_parallel))
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def layer_spec():
    """Megatron's local GPT layer spec (qk RMSNorm) with :class:`PackedCoreAttention` as core
    attention and :class:`TorchRMSNorm` as every norm; on the NPU the MLP's activation module is
    :class:`FusedSwiGLU` (:func:`areal_npu.train.megatron.model.transformer_config` sets
    ``use_te_activation_func`` there, the switch that makes Megatron's MLP build it)."""
    import_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from areal_npu.train.megatron.attention import PackedCoreAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = PackedCoreAttention
    attention.q_layernorm = attention.k_layernorm = TorchRMSNorm
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    if fused_kernels():  # read by Megatron's MLP when the config sets use_te_activation_func
        spec.submodules.mlp.submodules.activation_func = FusedSwiGLU
    return spec
