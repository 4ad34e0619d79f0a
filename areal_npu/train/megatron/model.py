"""A Megatron-Core ``GPTModel`` built from a Hugging Face Qwen3 (dense) config, and its packed forward.

What runs where:

- **Qwen3 dense** (``model_type: qwen3``): here, on every device. Local layer spec (Megatron's own
  ``ColumnParallelLinear`` / ``RowParallelLinear``, torch ``RMSNorm``) with the core attention
  replaced by :class:`areal_npu.train.megatron.attention.PackedCoreAttention` (our packed kernel).
- **Qwen3.5 / 3.6 dense** (Gated DeltaNet hybrids, ``qwen3_5_text``; either checkpoint layout, the
  text model trains): :mod:`.hybrid` -- per layer type, gated full attention or our tensor-parallel
  Gated DeltaNet (:mod:`.gdn`: transformers' torch layer, the path the FSDP2 engine takes on the CPU
  and on Ascend). Megatron-Core 0.16.1's own ``GatedDeltaNet`` refuses packed (THD) sequences and
  needs FLA's Triton kernels; on the NPU MindSpeed's packed gated delta rule, fused RMSNorm and
  SwiGLU are wired (:mod:`.npu_fused`; checked with recording fakes only, never run on an NPU).
  Sequence and context parallelism: the Gated DeltaNet layers gather their rows (:mod:`.hybrid`). MoE variants and Qwen3-Next are refused.
- Refused everywhere (a sentence each): attention bias, sliding windows, RoPE scaling, MoE.

Recomputation (``train.gradient_checkpointing``, :func:`recompute_fields`): Megatron's own full,
uniform, one-layer recomputation -- each decoder layer's forward runs again in backward through
``megatron.core.tensor_parallel.random.CheckpointFunction``, which saves and restores the RNG
states (on the CPU through :mod:`areal_npu.compat.megatron`'s RNG shim; on the NPU MindSpeed's
adaptor maps the CUDA RNG calls, unverified here). The core attention runs again inside it: it is
deterministic (no dropout; the same kernel and inputs).

The mapping HF <-> Megatron of the config (this module) and the weights
(:mod:`areal_npu.train.megatron.convert`) is written out explicitly; on the images Megatron-Bridge
is the intended path (see that module for why it is not used here).
"""

from __future__ import annotations

import torch

from areal_npu.train.megatron.hybrid import check_hybrid_layout, hybrid_layer_specs
from areal_npu.train.megatron.npu_fused import fused_kernels
from areal_npu.train.megatron.runtime import import_megatron
from areal_npu.train.megatron.shape import HYBRID_TYPES, GPTShape, gpt_shape, text_config
from areal_npu.train.megatron.specs import TorchRMSNorm, layer_spec

__all__ = [
    "build_gpt_model",
    "check_layout",
    "check_supported",
    "decoder_hidden_states",
    "model_options",
    "recompute_fields",
    "transformer_config",
]

SUPPORTED_MODEL_TYPES = ("qwen3",)
QWEN35_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def check_supported(hf_config, device_type: str = "cpu") -> None:
    """Raise ``NotImplementedError`` with a sentence when this config cannot be built here."""
    cfg = text_config(hf_config)
    model_type = getattr(cfg, "model_type", None)
    if model_type in HYBRID_TYPES:
        pass  # :mod:`.hybrid`
    elif model_type in QWEN35_TYPES or "linear_attention" in (getattr(cfg, "layer_types", None) or []):
        raise NotImplementedError(
            f"{model_type}: the Megatron engine maps dense Qwen3.5/3.6 (qwen3_5_text), not their MoE "
            f"variants or Qwen3-Next (on {device_type} or any device). Use train.backend=fsdp2"
        )
    elif model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"the Megatron engine builds {', '.join(SUPPORTED_MODEL_TYPES)} models, not {model_type!r}"
        )
    if getattr(cfg, "attention_bias", False):
        raise NotImplementedError("attention_bias=True is not mapped (Qwen3 has none)")
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not supported by the packed attention")
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"RoPE scaling {rope.get('rope_type')!r} is not mapped")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not mapped (SwiGLU only)")


def check_divisible(shape: GPTShape, tp_size: int) -> None:
    """TP shards query heads, the FFN and the vocabulary: each must divide evenly. KV heads (query
    groups) may be fewer than TP ranks when ``tp_size`` is a multiple of them (Megatron-Core 0.16.1
    ``TransformerConfig`` accepts either way round): the fused ``linear_qkv`` is still split evenly
    by rows, and ``SelfAttention.get_query_key_value_tensors`` all-gathers its output over TP and
    keeps its own group's key/value (replicated in compute) and its ``Hq / tp`` query heads; so the
    fused rows ``(Hq + 2 G) d`` must divide by ``tp_size`` too."""
    for what, n in (
        ("num_attention_heads", shape.num_heads),
        ("intermediate_size", shape.ffn_hidden_size),
        ("vocab_size", shape.vocab_size),
    ):
        if n % tp_size:
            raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")
    groups = shape.num_query_groups
    if groups % tp_size and tp_size % groups:
        raise ValueError(
            f"num_key_value_heads={groups} and tp_size={tp_size}: one must be a multiple of the other "
            "(KV heads split over TP ranks, or each KV head replicated on tp_size / num_key_value_heads ranks)"
        )
    rows = (shape.num_heads + 2 * groups) * shape.head_dim
    if rows % tp_size:
        raise ValueError(
            f"the fused QKV rows (num_attention_heads + 2 num_key_value_heads) * head_dim = {rows} "
            f"are not divisible by tp_size={tp_size}"
        )


def check_layout(
    hf_config, tp_size: int, pp_size: int = 1, cp_size: int = 1, sequence_parallel: bool = False
) -> None:
    """What a TP x PP layout needs of the model (:func:`check_divisible`; layers split evenly over
    pipeline stages; a Qwen3.5 hybrid's limits, :func:`.hybrid.check_hybrid_layout`); ``ValueError``
    naming the size otherwise. CP needs nothing of a dense model: the packer pads every sequence to a
    multiple of ``2 * cp``."""
    shape = gpt_shape(hf_config)
    check_divisible(shape, tp_size)
    check_hybrid_layout(shape, tp_size, cp_size, sequence_parallel)
    if shape.num_layers % pp_size:
        raise ValueError(f"num_hidden_layers={shape.num_layers} is not divisible by pp_size={pp_size}")
    if pp_size > 1 and shape.tie_word_embeddings:
        raise ValueError(
            f"tie_word_embeddings with pp_size={pp_size}: the embedding (first stage) and the output "
            "layer (last stage) would be one weight on two stages, which this engine does not keep in "
            "step (Megatron's embedding group); use pp_size 1 for a tied model"
        )


def transformer_config(
    hf_config,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    pp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    cpu_init: bool = True,
    sequence_parallel: bool = False,
    recompute: bool = False,
    **overrides,
):
    """Megatron ``TransformerConfig`` equal in function to the HF Qwen3 config (``overrides``: more
    ``TransformerConfig`` fields, e.g. the MTP layer's ``attention_output_gate``; ``recompute``:
    :func:`recompute_fields`).

    Qwen3 layer: ``x + o(attn(rope(q_norm(q)), rope(k_norm(k)), v))`` with pre-RMSNorm, then
    ``x + down(silu(gate(n(x))) * up(n(x)))``; Megatron: qk_layernorm, gated_linear_unit with silu,
    RMSNorm, no biases, rotary non-interleaved (rotate-half) -- the same functions. Fusions that
    need CUDA/Apex kernels are off (the local spec does not use them anyway). Pipeline stages
    (``pp_size``) exchange activations of every micro-batch's own length (``variable_seq_lengths``:
    packed micro-batches differ in length), and the schedule leaves the loss unscaled
    (``calculate_per_token_loss``: the engine's losses are globally normalised already)."""
    core = import_megatron()  # noqa: F841  (MindSpeed first on the NPU)
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = gpt_shape(hf_config)
    check_divisible(shape, tp_size)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=cp_size,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=dtype,
        variable_seq_lengths=pp_size > 1,
        # TransformerConfig refuses variable lengths with the MoE "allgather" dispatcher even for a
        # dense model (no experts: the dispatcher is never built)
        moe_token_dispatcher_type="alltoall",
        batch_p2p_comm=False,  # plain isend/irecv pairs (gloo on the CPU, HCCL/NCCL elsewhere)
        calculate_per_token_loss=True,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init,
        perform_initialization=False,  # weights come from the HF checkpoint
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        use_te_activation_func=fused_kernels(),  # the MLP builds the spec's FusedSwiGLU (NPU only)
        **{"attention_output_gate": shape.hybrid, **recompute_fields(recompute), **overrides},
    )


def recompute_fields(recompute: bool) -> dict:
    """``TransformerConfig`` fields of activation recomputation: every decoder layer (and the MTP
    layer, :func:`areal_npu.train.megatron.mtp.mtp_forward`) keeps only its input and runs its
    forward again in backward (``full`` granularity, ``uniform`` method, one layer per unit)."""
    if not recompute:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def model_options(train) -> dict:
    """The :func:`build_gpt_model` keywords of a ``train`` config (``backend: megatron``)."""
    layout = train.megatron
    return dict(
        tp_size=layout.tp_size,
        cp_size=layout.cp_size,
        pp_size=layout.pp_size,
        sequence_parallel=layout.sequence_parallel,
        recompute=train.gradient_checkpointing,
    )


def block_spec(hf_config, layers: range):
    """The decoder layers ``layers`` (global indices: one pipeline stage's): :func:`layer_spec` per
    layer (a Qwen3.5 hybrid's per layer type, :mod:`.hybrid`) and a :class:`TorchRMSNorm` final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    shape = gpt_shape(hf_config)
    specs = hybrid_layer_specs(hf_config, shape, layers) if shape.hybrid else [layer_spec()] * len(layers)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TorchRMSNorm)


def build_gpt_model(
    hf_config,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    pp_size: int = 1,
    dtype=torch.float32,
    device=None,
    sequence_parallel: bool = False,
    recompute: bool = False,
):
    """An uninitialised ``GPTModel`` for ``hf_config`` on ``device`` (load weights with
    :func:`areal_npu.train.megatron.convert.load_hf_weights`). Needs :func:`init_parallel_state`.
    ``sequence_parallel``: the decoder's output is this TP rank's share of the tokens; ``recompute``:
    each decoder layer recomputed in backward (:func:`recompute_fields`); ``pp_size``: this rank's
    pipeline stage only (its layers; the embedding on the first, the head on the last)."""
    from areal_npu.platform import current_platform

    platform = current_platform()
    check_supported(hf_config, platform.device_type)
    import_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    check_layout(hf_config, tp_size, pp_size, cp_size, sequence_parallel)
    cfg = transformer_config(
        hf_config,
        tp_size=tp_size,
        cp_size=cp_size,
        pp_size=pp_size,
        dtype=dtype,
        cpu_init=platform.device_type == "cpu",
        sequence_parallel=sequence_parallel,
        recompute=recompute,
    )
    shape = gpt_shape(hf_config)
    per_stage = shape.num_layers // pp_size
    first = (ps.get_pipeline_model_parallel_rank() if pp_size > 1 else 0) * per_stage
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=block_spec(hf_config, range(first, first + per_stage)),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pp_size == 1 or ps.is_pipeline_first_stage(),
        post_process=pp_size == 1 or ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=shape.rotary_percent,
        rotary_base=shape.rope_theta,
    )
    return model.to(device=device or platform.current_device())


def decoder_hidden_states(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    packed_seq_params,
    with_rotary: bool = False,
    squeeze: bool = True,
):
    """Final-norm hidden states ``[t, H]`` of one packed row (``input_ids`` ``[t]``, this rank's
    tokens): ``GPTModel.forward`` up to (not including) the output layer, so the engine computes
    log-probs with its own chunked, vocab-parallel kernel instead of materialising ``[t, V]`` logits.
    ``with_rotary``: also the RoPE table the decoder used (the MTP layer reuses it). On a pipeline
    stage the decoder starts from the tensor the schedule set (``set_input_tensor``) unless it is
    the first, and ends without the final norm unless it is the last."""
    out = model._preprocess(
        input_ids=input_ids[None], position_ids=position_ids[None], packed_seq_params=packed_seq_params
    )
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = out[:5]
    hidden = model.decoder(
        hidden_states=decoder_input,
        attention_mask=None,
        rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos,
        rotary_pos_sin=rotary_pos_sin,
        packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset,
    )
    if not squeeze:  # [t, 1, H], as pipeline stages exchange it
        return (hidden, rotary_pos_emb) if with_rotary else hidden
    if with_rotary:
        return hidden[:, 0], rotary_pos_emb
    return hidden[:, 0]  # [t, 1, H] -> [t, H]
