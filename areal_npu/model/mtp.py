"""The Qwen3.5/3.6 multi-token-prediction (MTP) head, in the checkpoint layout vLLM drafts from.

Checkpoint names (all under ``mtp.``): ``fc`` [H, 2H], ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``layers.{i}.*`` (a full-attention Qwen3.5 decoder layer), ``norm``.
Norms are zero-centred, ``(1 + w) * x / rms(x)``. The embedding and the output head are shared
with the main model and are not part of this module.

Depth d (1-based) at position t:

    x_t^(1) = fc([ pre_fc_norm_embedding(E[ids_{t+1}]) ; pre_fc_norm_hidden(h_t) ])
    x_t^(d) = fc([ pre_fc_norm_embedding(E[ids_{t+d}]) ; pre_fc_norm_hidden(h_t^(d-1)) ])
    h_t^(d) = norm(layer_{(d-1) mod n}(x^(d)))_t,     logits_t^(d) = W_out h_t^(d)  ->  predicts ids_{t+1+d}

where h is the backbone's last hidden state after its final norm (transformers' ``last_hidden_state``,
which is also what vLLM hands its drafter).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

MTP_PREFIX = "mtp."


def _text_classes():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding


class Qwen35MTP(nn.Module):
    """``mtp.*`` of a Qwen3.5 text checkpoint: ``num_layers`` full-attention blocks and the fc mixer."""

    def __init__(self, config, num_layers: int | None = None):
        super().__init__()
        decoder_layer_cls, rms_norm_cls, rotary_cls = _text_classes()
        hidden = config.hidden_size
        self.num_layers = int(num_layers or getattr(config, "mtp_num_hidden_layers", 1) or 1)
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"] * self.num_layers
        layer_config.num_hidden_layers = self.num_layers
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = rms_norm_cls(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = rms_norm_cls(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(decoder_layer_cls(layer_config, i) for i in range(self.num_layers))
        self.norm = rms_norm_cls(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_cls(layer_config)
        self.config = layer_config

    def step(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        depth: int = 1,
        **attention_kwargs,
    ) -> torch.Tensor:
        """One MTP depth: ``hidden`` [B, T, H] at t, ``next_embeds`` [B, T, H] of token t+depth."""
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        )
        position_embeddings = self.rotary_emb(x, position_ids)
        layer = self.layers[(depth - 1) % self.num_layers]
        x = layer(x, position_embeddings=position_embeddings, position_ids=position_ids, **attention_kwargs)
        if isinstance(x, tuple):
            x = x[0]
        return self.norm(x)


def init_mtp_weights(module: Qwen35MTP, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Random init like the base model's ``_init_weights``: normal linears, zero (= identity) norms."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:
                param.zero_()


def mtp_state_dict(module: Qwen35MTP) -> dict[str, torch.Tensor]:
    """Parameters under their checkpoint names (``mtp.``-prefixed; buffers such as rotary excluded)."""
    return {MTP_PREFIX + name: p.detach().contiguous() for name, p in module.named_parameters()}
