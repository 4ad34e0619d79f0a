"""The Qwen3.5/3.6 multi-token-prediction (MTP) head, in the checkpoint layout vLLM drafts from.

Checkpoint names (all under ``mtp.``): ``fc`` [H, 2H], ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``layers.{i}.*`` (a full-attention Qwen3.5 decoder layer), ``norm``.
Norms are zero-centred, ``(1 + w) * x / rms(x)``. The embedding ``E`` and the output head ``W``
are shared with the main model and are not part of this module.

Depth d (1-based) at packed index t, exactly what vLLM's ``Qwen3_5MTP`` drafter and its proposer
(``vllm/v1/spec_decode/llm_base_proposer.py``) compute:

    x_t^(d) = fc([ pre_fc_norm_embedding(E[ids_{t+d}]) ; pre_fc_norm_hidden(h_t^(d-1)) ])
    h_t^(d) = norm(layers[0](x^(d), positions = pos_t + d - 1))_t
    logits_t^(d) = W h_t^(d)   ->  predicts ids_{t+1+d}

``h^(0)`` is the backbone's last hidden state *after* its final norm (transformers'
``last_hidden_state``; vLLM's ``Qwen3_5Model.forward`` returns the same). Deeper steps feed the
previous depth's output, post ``mtp.norm`` (the proposer passes the drafter's returned hidden
states), at position ``+1`` per step.

Every depth runs ``layers.0``, whatever ``n = mtp_num_hidden_layers`` is, because that is what vLLM
0.32 serves: its ``Qwen3_5MultiTokenPredictor.forward`` would pick ``layers[spec_step_idx % n]``, but
the drafter it is wrapped in (``Qwen3_5MTP.forward``) calls it without ``spec_step_idx`` (and the
proposer passes none), so the index is always 0 (:func:`vllm_draft_layer_index`; checked against
vLLM's module in ``tests/model/test_mtp_vllm_layer.py``). Layers ``1..n-1`` of a checkpoint that has
them are kept and saved but never trained or synced (:meth:`Qwen35MTP.named_drafting_parameters`),
and a new head with more than one layer is refused (``num_layers``). Every released Qwen3.5/3.6
has n = 1.

Training runs each depth over the whole packed row with causal attention *inside that depth*. At
d = 1 this is vLLM's computation exactly. At d >= 2 vLLM's draft attends to depth-1 keys for the
prefix and to its own chain for the last d-1 positions; training's keys are all depth-d. That is the
usual MTP/EAGLE training approximation (Megatron and DeepSeek-V3 train the same way).

Gradient isolation (the MTP loss never trains what it reads): :meth:`Qwen35MTP.forward` takes ``h^(0)`` and ``E``
detached, and the loss (:func:`areal_npu.model.mtp_loss.mtp_loss`, chunked over tokens so no
``[T, V]`` logits exist) and :func:`mtp_logits` take ``W`` detached, so backbone, embedding and
output head get no gradient from the MTP loss. Between depths the graph is kept: the depth-d loss reaches the
blocks of depths < d.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from areal_npu.names import MTP_PREFIX

__all__ = [
    "MTPConfig",
    "Qwen35MTP",
    "init_mtp_weights",
    "mtp_layer_config",
    "mtp_logits",
    "mtp_state_dict",
    "vllm_draft_layer_index",
]


@dataclass
class MTPConfig:
    """The MTP head in training.

    Modes (see :func:`areal_npu.model.mtp_params.mtp_mode`):

    - ``enabled=False``: no head.
    - ``train=True``: joint training; the head's loss is added to the policy/SFT loss, the head is
      in the optimizer and synced to the rollout engines with the policy.
    - ``train=False``: frozen head loaded once; not in the optimizer, not synced.
    - ``train=True, mtp_only=True``: only the head trains, on a frozen base (warm start of a weak
      draft); the policy is neither in the optimizer nor synced.

    Each setting has its one default here (:func:`areal_npu.model.mtp_loss.mtp_loss` defaults to
    ``MTPConfig.loss_scale``). :meth:`validate` runs once, with the recipe
    (:func:`areal_npu.config.validate_tree`); the engines and helpers take the validated config.
    """

    enabled: bool = False
    num_depths: int = 1  # depths trained; match rollout's num_speculative_tokens for k > 1
    loss_scale: float = 0.1  # total = loss_scale / num_depths * sum_d CE_d (Megatron's convention)
    train: bool = True
    mtp_only: bool = False
    init_new_head: bool = False  # allow a checkpoint without mtp.* weights: random-initialise the head
    num_layers: int = 0  # mtp_num_hidden_layers for a new head: 0 (the checkpoint's config, else 1) or 1
    init_std: float = 0.0  # new-head init std; 0: the model's initializer_range
    lr_scale: float = 1.0  # the head's learning rate relative to the policy's (joint mode)

    def validate(self) -> None:
        if self.num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {self.num_depths}")
        if not (math.isfinite(self.loss_scale) and self.loss_scale >= 0):
            raise ValueError(f"loss_scale must be a finite number >= 0, got {self.loss_scale}")
        if self.mtp_only and not self.train:
            raise ValueError("mtp_only needs train=true (it trains the head alone)")
        if self.mtp_only and not self.enabled:
            raise ValueError("mtp_only needs enabled=true")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.num_layers > 1:
            raise ValueError(
                f"num_layers={self.num_layers}: vLLM 0.32 drafts every depth with mtp.layers.0, so "
                "layers 1.. would never draft; use num_layers=1 (or 0: the checkpoint's)"
            )
        if self.init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {self.init_std}")
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            raise ValueError(f"lr_scale must be > 0, got {self.lr_scale}")


def vllm_draft_layer_index(depth: int, num_layers: int) -> int:
    """The ``mtp.layers`` block vLLM 0.32 drafts depth ``depth`` (1-based) with: always 0.

    vLLM's predictor selects ``layers[spec_step_idx % num_layers]``, but ``Qwen3_5MTP.forward``
    (the module the proposer calls) drops ``spec_step_idx``, so the index is ``0 % num_layers``.
    """
    if depth < 1 or num_layers < 1:
        raise ValueError(f"depth and num_layers must be >= 1, got {depth}, {num_layers}")
    return 0


def rotary_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``[3, B, T]``: Qwen3.5's rotary embedding takes the mrope layout (temporal,
    height, width); a text token has the same position in all three. transformers 5.17 and 5.18
    index ``position_ids[:, :, None, :]`` and reject 2-D ids; the 3-D layout works in every version."""
    return position_ids[None].expand(3, *position_ids.shape)


def _text_classes():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm, m.Qwen3_5TextRotaryEmbedding


def mtp_layer_config(config, num_layers: int):
    """A Qwen3.5 text config for ``num_layers`` full-attention MTP blocks, from the base model's
    config (Qwen3.5: a copy; any other decoder such as Qwen3: its shapes, rope and eps)."""
    from transformers import Qwen3_5TextConfig

    from areal_npu.model.packed import register_packed_attention

    if isinstance(config, Qwen3_5TextConfig):
        layer_config = copy.deepcopy(config)
    else:
        rope = dict(
            getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        )
        rope.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        layer_config = Qwen3_5TextConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            attention_bias=getattr(config, "attention_bias", False),
            rope_parameters=rope,
            num_hidden_layers=num_layers,
            layer_types=["full_attention"] * num_layers,
        )
    layer_config.layer_types = ["full_attention"] * num_layers
    layer_config.num_hidden_layers = num_layers
    layer_config.attention_dropout = 0.0
    # Packed attention also serves padded rows (each row one causal sequence) and every device.
    layer_config._attn_implementation = register_packed_attention()
    return layer_config


class Qwen35MTP(nn.Module):
    """``mtp.*`` of a Qwen3.5 text checkpoint: ``num_layers`` full-attention blocks and the fc mixer."""

    def __init__(self, config, num_layers: int | None = None):
        super().__init__()
        decoder_layer_cls, rms_norm_cls, rotary_cls = _text_classes()
        hidden = config.hidden_size
        self.num_layers = int(num_layers or getattr(config, "mtp_num_hidden_layers", 1) or 1)
        layer_config = mtp_layer_config(config, self.num_layers)
        eps = layer_config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = rms_norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = rms_norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList(decoder_layer_cls(layer_config, i) for i in range(self.num_layers))
        self.norm = rms_norm_cls(hidden, eps=eps)
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
        """One MTP depth: ``hidden`` [B, T, H] at t, ``next_embeds`` [B, T, H] of token t+depth;
        ``position_ids`` are the ones this depth runs at. Returns the post-``norm`` hidden state."""
        x = self.fc(
            torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        )
        position_embeddings = self.rotary_emb(x, rotary_position_ids(position_ids))
        layer = self.layers[vllm_draft_layer_index(depth, self.num_layers)]
        x = layer(x, position_embeddings=position_embeddings, position_ids=position_ids, **attention_kwargs)
        if isinstance(x, tuple):
            x = x[0]
        return self.norm(x)

    def named_drafting_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters vLLM drafts with (all but ``layers.1..``): the ones worth training and syncing."""
        drafted = f"layers.{vllm_draft_layer_index(1, self.num_layers)}."
        return [
            (name, p)
            for name, p in self.named_parameters()
            if not name.startswith("layers.") or name.startswith(drafted)
        ]

    def forward(
        self,
        hidden: torch.Tensor,
        embed_ids: torch.Tensor | Sequence[torch.Tensor],
        position_ids: torch.Tensor,
        embed_weight: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        num_depths: int | None = None,
    ) -> list[torch.Tensor]:
        """Post-norm MTP hidden states of depths 1..D (see the module docstring).

        ``hidden``: backbone last hidden state (post final norm), [B, T, H] or packed [T, H];
        ``embed_ids[d-1]``: the token fed at depth d, ``ids_{t+d}`` (:func:`build_mtp_targets`'s
        ``embed_ids``), shaped like ``hidden[..., 0]``; ``position_ids``: the backbone's (restarting
        per packed segment); ``cu_seqlens``: packed segment boundaries (a packed row is ``B == 1``
        or 1-D; without them one row is split where ``position_ids`` restart at 0). Rows of a
        ``B > 1`` batch are each one causal sequence (right padding only).
        ``hidden`` and ``embed_weight`` are detached here: nothing flows back into the backbone.
        """
        squeeze = hidden.dim() == 2
        if squeeze:
            hidden = hidden.unsqueeze(0)
        depths = len(embed_ids) if num_depths is None else num_depths
        if depths < 1 or depths > len(embed_ids):
            raise ValueError(f"num_depths={depths} but embed_ids holds {len(embed_ids)} depths")
        if position_ids.numel() != hidden.shape[0] * hidden.shape[1]:
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}, hidden {tuple(hidden.shape)}"
            )
        position_ids = position_ids.reshape(hidden.shape[:2])
        kwargs: dict = {}
        if cu_seqlens is None and hidden.shape[0] == 1:
            # Segments from the *unshifted* positions: depth d runs at positions + d - 1, which no
            # longer restart at 0, so the attention could not find the boundaries itself.
            from areal_npu.data.packed_layout import cu_seqlens_from_position_ids

            cu_seqlens = cu_seqlens_from_position_ids(position_ids)
        if cu_seqlens is not None:
            if hidden.shape[0] != 1:
                raise ValueError(f"a packed batch is one row; hidden has {hidden.shape[0]} rows")
            cu = cu_seqlens.to(device=hidden.device, dtype=torch.int32)
            if max_seqlen is None:
                max_seqlen = int((cu[1:] - cu[:-1]).max())
            kwargs = {
                "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu,
                "max_length_q": max_seqlen,
                "max_length_k": max_seqlen,
            }
        state = hidden.detach()
        weight = embed_weight.detach()
        outputs = []
        for d in range(1, depths + 1):
            ids = embed_ids[d - 1].reshape(hidden.shape[:2]).to(hidden.device)
            state = self.step(state, F.embedding(ids, weight), position_ids + (d - 1), depth=d, **kwargs)
            outputs.append(state.squeeze(0) if squeeze else state)
        return outputs


def mtp_logits(mtp_hidden: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
    """Logits of one depth through the *shared, detached* output head: ``h W^T`` (fp32 out).
    Materialises ``[..., V]``: for inspection and small sizes; the loss never calls it."""
    return F.linear(mtp_hidden, output_weight.detach()).float()


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
