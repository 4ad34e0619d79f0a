"""Peak memory per device of one training step: a pure estimate from model dims, tokens and layout.

:func:`estimate_step_memory` adds up, in bytes per device:

- **parameters** (fp32 master), **gradients** (fp32) and **AdamW states** (``exp_avg``,
  ``exp_avg_sq``: 2 x fp32), split over tensor and pipeline parallelism and over the
  data-parallel ranks (FSDP2 shards all three; Megatron's distributed optimizer the fp32 masters
  and states only);
- **compute copies**: FSDP2 all-gathers every parameter group in the compute dtype before it runs
  (the root group -- embedding, output head, final norm, MTP fc and norms -- stays gathered for the
  whole forward and backward; a decoder layer is gathered while it runs, with one prefetched), and
  a layer's gradient exists unsharded in the compute dtype and again in fp32 for the reduce-scatter;
- **activations** saved for backward, per token and per layer (formulas below), for every layer
  of the policy and every MTP depth; with activation checkpointing only each layer's input is
  kept and one layer at a time is recomputed;
- **Gated DeltaNet sequence-parallel gather** (Megatron with sequence or context parallelism): the
  layer gathers its whole ``[T, h]`` input row and sums its ``[T, h]`` output back (one layer at a
  time with checkpointing; every such layer's gathered input without);
- **backward working memory**: the gradients of one layer's activations and of the residual stream;
- **log-prob chunk buffers** of the chunked kernel (:mod:`areal_npu.kernels.logprobs`): two
  ``[chunk, vocab]`` float32 buffers, the float32 copy of a half-precision head and the float32
  head-gradient accumulator; the MTP loss reuses the same kernel (one depth at a time);
- **per-token bookkeeping**: token ids, positions, targets, masks, log-probs, loss terms.

The forward/backward peak is compared with the optimizer-step peak (parameters, gradients and
states plus one fp32 temporary of the parameter size, what AdamW's foreach path allocates), and the
larger one is the estimate. Optimizer states are counted from the first step on (steady state).
Every term is added at its own maximum, so the estimate is an upper bound by construction; on the
tests' 64K-token step of a tiny hybrid model it is 1.33x the measured peak (1.79x with activation
checkpointing).

**Activations per token per layer** (bytes; ``c`` = compute dtype bytes, 2 for bf16), counted from
the tensors autograd saves in transformers 5.9-5.19's Qwen3.5 decoder layer (``Qwen3_5DecoderLayer``:
zero-centred RMSNorms that upcast to fp32, gated attention, SwiGLU MLP; the Gated DeltaNet through
its PyTorch chunked fallback ``torch_chunk_gated_delta_rule``, chunk ``C = 64``, which is the path
on CPU and on Ascend) and checked, when derived, against the saved-tensor bytes of real layers
over 12 shapes (``tests/train/test_step_memory.py`` re-checks three); ``h`` hidden, ``I`` MLP
width, ``nq``/``nkv`` attention heads of size ``d``, ``Hk``/``Hv`` Gated DeltaNet key/value heads
of sizes ``dk``/``dv``:

    two norms + MLP     (16 + 2c)·h + 4c·I
    full attention      (4 + 7c)·nq·d + (8 + 2c)·nkv·d + 4·nq + 4·nkv + 8
    Gated DeltaNet      4c·Hk·dk + 32·Hv·dk + (24 + 5c)·Hv·dv + (20·C + 40)·Hv + 3·Hv·dk·dv / C + 8

(bf16: exact on all 12 shapes. fp32: the full-attention formula is exact; the Gated DeltaNet
layer then saves some inputs instead of copies, and ``32h + 16I + 24·Hk·dk + 48·Hv·dk + 48·Hv·dv +
1320·Hv + 3·Hv·dk·dv/C + 16`` bounds it, 5-11 % high.) The ``C``-sized terms are the fallback's
intra-chunk ``[C, C]`` matrices; ``Hv·dk·dv / C`` is one recurrent state saved per chunk. A fused
Gated DeltaNet kernel (flash-linear-attention, a Megatron/MindSpeed one) saves far less: pass
``gdn_bytes_per_token`` to override. For comparison, Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") count ``34·h`` bytes per token per GPT layer
(fp16, 4h MLP, dropout masks) plus ``5·a·s`` for the attention scores, which flash attention does
not keep. The coefficients differ here because these RMSNorms keep fp32 copies of their inputs and
outputs, the MLP is SwiGLU of width ``I``, attention is gated and grouped-query, and there is no
dropout.

An MTP depth is one full-attention layer plus its fc mixer and three norms: ``+ (24 + 3c)·h``.

**Parallel layout** (:class:`ParallelLayout`): ``dp`` shards parameters, gradients and optimizer
states (FSDP2; a Megatron distributed optimizer shards only fp32 masters and states, over dp x cp); ``tp``
divides every weight matrix and (with sequence parallelism) the activations; ``cp`` divides the
tokens of a micro-batch; ``pp`` gives each stage ``ceil(L / pp)`` layers, and with 1F1B the first
stage holds ``pp`` micro-batches in flight, so pipeline parallelism divides weights, not
activations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

__all__ = [
    "MemoryEstimate",
    "ModelDims",
    "ParallelLayout",
    "estimate_step_memory",
    "format_memory_table",
    "layer_activation_bytes",
]

GIB = 2**30
GDN_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk size
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BACKWARD_FACTOR = 0.5


@dataclass(frozen=True)
class ModelDims:
    """The shapes that set a Qwen3.5-style (dense, hybrid) model's training memory."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    layer_types: tuple[str, ...]  # "full_attention" | "linear_attention" per decoder layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0

    @classmethod
    def from_hf_config(cls, config) -> ModelDims:
        """From a transformers config (or its dict): a Qwen3.5 text config, the published outer
        config (its ``text_config`` is read), or any dense decoder with the usual field names
        (layers without ``layer_types`` are full attention)."""
        if not isinstance(config, Mapping):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        text = config.get("text_config") or config
        if not isinstance(text, Mapping):
            text = text.to_dict()
        if text.get("num_experts") or text.get("n_routed_experts"):
            raise ValueError("mixture-of-experts configs are not modelled (dense MLP only)")
        n = int(text["num_hidden_layers"])
        layer_types = tuple(text.get("layer_types") or ["full_attention"] * n)
        heads = int(text["num_attention_heads"])
        return cls(
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            vocab_size=int(text["vocab_size"]),
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
            linear_num_key_heads=int(text.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(text.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(text.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(text.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim") or 4),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers") or 0),
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    # ---- parameters -------------------------------------------------------------------------
    def full_layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * 2 * self.num_attention_heads * d  # q and its output gate
        attn += 2 * h * self.num_key_value_heads * d + self.num_attention_heads * d * h + 2 * d
        return attn + self._mlp_and_norms()

    def linear_layer_params(self) -> int:
        h = self.hidden_size
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        conv_dim = 2 * hk * dk + hv * dv
        gdn = h * conv_dim + h * hv * dv + 2 * h * hv  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        gdn += conv_dim * self.linear_conv_kernel_dim + 2 * hv + dv + hv * dv * h  # conv, dt/A, norm, out
        return gdn + self._mlp_and_norms()

    def _mlp_and_norms(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    def root_params(self, with_mtp: bool) -> int:
        """The FSDP root group: embedding, output head, final norm (+ MTP fc and norms)."""
        h = self.hidden_size
        n = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        return n + (2 * h * h + 3 * h if with_mtp else 0)

    def num_parameters(self, with_mtp: bool = False) -> int:
        layers = sum(
            self.full_layer_params() if t == "full_attention" else self.linear_layer_params()
            for t in self.layer_types
        )
        mtp_layers = max(self.mtp_num_hidden_layers, 1) * self.full_layer_params() if with_mtp else 0
        return self.root_params(with_mtp) + layers + mtp_layers


@dataclass(frozen=True)
class ParallelLayout:
    """How one step is spread over devices. ``backend``: ``fsdp2`` (parameters, gradients and
    states sharded over dp; compute copies gathered per layer) or ``megatron`` (compute-dtype
    weights resident, split by tp/pp only; fp32 main gradients dp-replicated; the distributed
    optimizer shards the fp32 masters and states over dp)."""

    dp: int = 1  # data parallel
    tp: int = 1  # tensor parallel (weights and, with sequence parallelism, activations)
    cp: int = 1  # context parallel (tokens of a micro-batch)
    pp: int = 1  # pipeline parallel (layers)
    backend: str = "fsdp2"

    def validate(self) -> None:
        for name in ("dp", "tp", "cp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.backend not in ("fsdp2", "megatron"):
            raise ValueError(f"backend must be fsdp2 or megatron, got {self.backend!r}")


def _c(compute_dtype: str) -> int:
    if compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"compute_dtype must be one of {sorted(DTYPE_BYTES)}, got {compute_dtype!r}")
    return DTYPE_BYTES[compute_dtype]


def layer_activation_bytes(dims: ModelDims, layer_type: str, compute_dtype: str = "bfloat16") -> float:
    """Bytes saved for backward per token by one decoder layer (see the module docstring)."""
    c = _c(compute_dtype)
    h, i = dims.hidden_size, dims.intermediate_size
    if layer_type == "full_attention":
        nq, nkv, d = dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim
        attn = (4 + 7 * c) * nq * d + (8 + 2 * c) * nkv * d + 4 * nq + 4 * nkv + 8
        return (16 + 2 * c) * h + 4 * c * i + attn
    if layer_type == "linear_attention":
        hk, hv = dims.linear_num_key_heads, dims.linear_num_value_heads
        dk, dv = dims.linear_key_head_dim, dims.linear_value_head_dim
        state = 3 * hv * dk * dv / GDN_CHUNK
        if c == 4:  # fp32: some inputs are saved as themselves, not as copies; an upper bound
            return 32 * h + 16 * i + 24 * hk * dk + 48 * hv * dk + 48 * hv * dv + 1320 * hv + state + 16
        gdn = 4 * c * hk * dk + 32 * hv * dk + (24 + 5 * c) * hv * dv + (20 * GDN_CHUNK + 40) * hv + state + 8
        return (16 + 2 * c) * h + 4 * c * i + gdn
    raise ValueError(f"unknown layer type {layer_type!r}")


@dataclass
class MemoryEstimate:
    """Bytes per device. ``items``: the forward/backward-phase terms; ``peak``: the larger of their
    sum and ``optimizer_phase``."""

    items: dict[str, float]
    optimizer_phase: float
    inputs: dict = field(default_factory=dict)

    @property
    def forward_backward_phase(self) -> float:
        return sum(self.items.values())

    @property
    def peak(self) -> float:
        return max(self.forward_backward_phase, self.optimizer_phase)


def estimate_step_memory(
    dims: ModelDims,
    tokens_per_micro_batch: int,
    layout: ParallelLayout | None = None,
    *,
    compute_dtype: str = "bfloat16",
    gradient_checkpointing: bool = False,
    logprob_chunk_size: int = 2048,
    mtp_depths: int = 0,
    num_segments: int = 1,
    gdn_bytes_per_token: float | None = None,
    sequence_parallel: bool = False,
) -> MemoryEstimate:
    """Peak bytes per device of one training step (forward + backward of one packed micro-batch of
    ``tokens_per_micro_batch`` tokens, gradient accumulation, AdamW step).

    ``mtp_depths``: MTP depths trained (0: no head). ``num_segments``: packed sequences in the
    micro-batch (each pads the Gated DeltaNet fallback's chunking by up to C - 1 tokens).
    ``gdn_bytes_per_token``: replace the Gated DeltaNet formula (a fused kernel's footprint).
    ``sequence_parallel``: Megatron's sequence parallelism (the Gated DeltaNet gather below).
    """
    layout = layout or ParallelLayout()
    layout.validate()
    if tokens_per_micro_batch < 1 or logprob_chunk_size < 1 or mtp_depths < 0 or num_segments < 1:
        raise ValueError(
            "tokens_per_micro_batch, logprob_chunk_size, num_segments must be >= 1; mtp_depths >= 0"
        )
    c = _c(compute_dtype)
    h, v = dims.hidden_size, dims.vocab_size
    with_mtp = mtp_depths > 0
    tp, pp = layout.tp, layout.pp
    fsdp = layout.backend == "fsdp2"
    # Megatron's distributed optimizer shards the fp32 masters and states over DP x CP
    shard = layout.dp * tp * pp * (1 if fsdp else layout.cp)
    grad_shard = shard if fsdp else tp * pp
    params = dims.num_parameters(with_mtp)

    # Tokens this device holds activations for: cp and sequence-parallel tp split them.
    tokens = math.ceil(tokens_per_micro_batch / layout.cp)
    act_tokens = tokens / tp
    layers_per_stage = math.ceil(dims.num_layers / pp)
    in_flight = pp  # 1F1B: the first stage holds pp micro-batches
    # The stage's layer mix is the model's, scaled (Qwen3.5 interleaves the types evenly).
    n_full = sum(t == "full_attention" for t in dims.layer_types) * layers_per_stage / dims.num_layers
    n_linear = layers_per_stage - n_full

    def per_token(layer_type: str) -> float:
        if layer_type == "linear_attention" and gdn_bytes_per_token is not None:
            return gdn_bytes_per_token
        return layer_activation_bytes(dims, layer_type, compute_dtype)

    full_b = per_token("full_attention")
    linear_b = per_token("linear_attention") if n_linear else 0.0
    # Gated DeltaNet fallback pads every segment to a multiple of C (its chunk-internal tensors).
    gdn_pad = (GDN_CHUNK - 1) * num_segments / max(tokens, 1) if gdn_bytes_per_token is None else 0.0
    linear_b_padded = linear_b * (1 + gdn_pad)
    largest_layer = max(full_b, linear_b_padded)
    if gradient_checkpointing:
        saved = (n_full + n_linear) * c * h  # each layer's input
        recompute = largest_layer  # one layer's activations rebuilt in backward
    else:
        saved = n_full * full_b + n_linear * linear_b_padded
        recompute = 0.0
    mtp_layer = full_b + (24 + 3 * c) * h
    mtp_saved = mtp_depths * ((c * h + (24 + 3 * c) * h) if gradient_checkpointing else mtp_layer)
    if gradient_checkpointing and with_mtp:
        recompute = max(recompute, full_b)

    items: dict[str, float] = {}
    items["parameters (fp32 master)"] = 4 * params / shard
    items["gradients (fp32)"] = 4 * params / grad_shard
    items["optimizer states (AdamW, 2 x fp32)"] = 8 * params / shard
    if fsdp:
        root = dims.root_params(with_mtp) / tp
        layer_max = max(dims.full_layer_params(), dims.linear_layer_params() if n_linear else 0) / tp
        # Gathered compute copies (root + the running layer + one prefetched) and unsharded
        # gradients of the root and one layer (compute dtype, then the fp32 reduce-scatter copy).
        items["compute copies and unsharded grads"] = c * (root + 2 * layer_max) + (c + 4) * (
            root + layer_max
        )
    else:
        items["compute-dtype weights"] = c * params / (tp * pp)
    items["activations (saved for backward)"] = act_tokens * in_flight * saved
    items["MTP head activations"] = act_tokens * in_flight * mtp_saved
    # Gated DeltaNet under sequence (TP) / context parallelism: the layer all-gathers its input row
    # over TP, then CP (train/megatron/hybrid.py, gdn.py): the whole micro-batch's [T, h] in the
    # compute dtype, kept for the input projections' weight gradient, plus its [T, h] partial output
    # before the reduce-scatter. With checkpointing one layer holds both at a time; without, every
    # Gated DeltaNet layer of the stage keeps its gathered input (less the share counted above).
    split = (tp if sequence_parallel else 1) * layout.cp
    if n_linear and split > 1 and not fsdp:
        row = c * tokens_per_micro_batch * h
        kept = row if gradient_checkpointing else n_linear * in_flight * row * (1 - 1 / split)
        items["Gated DeltaNet sequence-parallel gather"] = kept + row
    # Backward: gradients of one layer's activations (measured: at most half its saved bytes at
    # once, as they are freed while it runs) + the residual stream's (compute dtype, x2).
    items["backward working memory"] = act_tokens * (BACKWARD_FACTOR * largest_layer + recompute + 2 * c * h)
    head_copy = v * h * 4 / tp if c != 4 else 0.0  # the kernel upcasts a half-precision head once
    items["log-prob chunk buffers"] = 2 * logprob_chunk_size * v / tp * 4 + head_copy + 4 * v * h / tp
    # ids, positions, targets, masks (int64/bool), log-probs, entropies, loss terms (fp32), the
    # final norm's saved fp32 copies and output, rotary cos/sin; per MTP depth its ids/labels/mask.
    bookkeeping = 256 + (8 + c) * h + 2 * c * dims.head_dim + mtp_depths * (17 + 2 * c * dims.head_dim)
    items["per-token bookkeeping"] = tokens * bookkeeping

    # params + grads + states + one fp32 temporary of the states' size (AdamW foreach sqrt)
    optimizer_phase = (4 + 8 + 4) * params / shard + 4 * params / grad_shard
    inputs = {
        "tokens_per_micro_batch": tokens_per_micro_batch,
        "layout": asdict(layout),
        "compute_dtype": compute_dtype,
        "gradient_checkpointing": gradient_checkpointing,
        "logprob_chunk_size": logprob_chunk_size,
        "mtp_depths": mtp_depths,
        "sequence_parallel": sequence_parallel,
        "parameters": params,
        "activation_bytes_per_token_per_layer": {"full_attention": full_b, "linear_attention": linear_b},
    }
    return MemoryEstimate(items, optimizer_phase, inputs)


def format_memory_table(estimate: MemoryEstimate, device_bytes: float | None = None) -> str:
    """A plain-text table of the estimate per device (GiB; MiB when the peak is under 1 GiB);
    with ``device_bytes`` the last line says whether it fits."""
    unit, scale = ("GiB", GIB) if estimate.peak >= GIB else ("MiB", 2**20)
    rows = list(estimate.items.items()) + [
        ("forward/backward peak", estimate.forward_backward_phase),
        ("optimizer-step peak", estimate.optimizer_phase),
        ("estimated peak", estimate.peak),
    ]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{'per device':<{width}}{unit:>10}"]
    lines += [f"{name:<{width}}{value / scale:>10.2f}" for name, value in rows]
    if device_bytes is not None:
        verdict = "fits" if estimate.peak <= device_bytes else "does NOT fit"
        lines.append(f"{verdict} in {device_bytes / GIB:.0f} GiB ({100 * estimate.peak / device_bytes:.0f}%)")
    return "\n".join(lines)
