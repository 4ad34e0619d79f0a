"""The shape facts of a Hugging Face decoder config that the model builder, the weight converter,
the Qwen3.5 hybrid layers and the MTP layer all need (:class:`GPTShape`), read once.

It sits below :mod:`.model`, :mod:`.hybrid`, :mod:`.convert` and :mod:`.mtp` and imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HYBRID_TYPES", "GPTShape", "gpt_shape", "text_config"]

HYBRID_TYPES = ("qwen3_5_text",)  # dense Qwen3.5 / 3.6 text models (:mod:`.hybrid`)


def text_config(hf_config):
    """The text model's config: a published (multimodal) checkpoint keeps it in ``text_config``."""
    return getattr(hf_config, "text_config", None) or hf_config


@dataclass(frozen=True)
class GPTShape:
    """The shape facts both the model builder and the weight converter need."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen3.5 / 3.6 hybrids (:mod:`.hybrid`): per layer "linear_attention" | "full_attention" (empty:
    # dense Qwen3), the Gated DeltaNet's (Hk, dk, Hv, dv, conv kernel) and the rotary fraction of a head
    layer_types: tuple[str, ...] = ()
    linear_dims: tuple[int, ...] = ()
    rotary_percent: float = 1.0

    @property
    def hybrid(self) -> bool:
        return bool(self.layer_types)


def gpt_shape(hf_config) -> GPTShape:
    cfg = text_config(hf_config)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    heads = cfg.num_attention_heads
    hybrid = {}
    if getattr(cfg, "model_type", None) in HYBRID_TYPES:
        hybrid = dict(
            layer_types=tuple(cfg.layer_types),
            linear_dims=(cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
                         cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim),  # fmt: skip
            rotary_percent=float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))),
        )
    return GPTShape(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=float(theta),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **hybrid,
    )
