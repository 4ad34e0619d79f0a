"""The EAGLE-3 drafter, in the checkpoint layout vLLM's ``eagle3`` method loads (``LlamaForCausalLMEagle3``).

vLLM (``vllm/model_executor/models/llama_eagle3.py``) reads the target's residual stream at the
auxiliary layers ``a_1..a_n`` (``eagle_aux_hidden_state_layer_ids``; id ``L`` is the stream after
``L`` decoder layers, 0 the embeddings: ``EagleModelMixin._maybe_add_hidden_state``) and drafts at
packed index t (position ``pos_t``, the target's), for depth d = 1..D:

    g_t^(1) = fc([ h_{a_1,t} ; ... ; h_{a_n,t} ])            g_t^(d) = r_t^(d-1)  (d >= 2)
    x       = [ input_layernorm(E[ids_{t+d}]) ; hidden_norm(g^(d)) ]          (2H wide)
    s       = g^(d) + o_proj(attn(q/k/v_proj(x), rope(pos_t + d - 1)))   (causal; d >= 2: chained)
    r^(d)   = s + mlp(post_attention_layernorm(s))
    logits_t^(d) = W norm(r_t^(d))   ->  predicts ids_{t+1+d}

Checkpoint names are this module's parameter names: ``fc.weight`` [H, nH],
``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H], ``o_proj``, ``midlayer.mlp.{gate,up,down}_proj``,
``norm.weight``. Norms are plain RMSNorms (``w * x / rms(x)``, init 1), rotary is NeoX style. No
``embed_tokens`` / ``lm_head``: vLLM then shares the target's (``_maybe_share_embeddings`` /
``_maybe_share_lm_head``), so the drafter keeps the full vocabulary (no ``d2t`` map). vLLM-Ascend
0.23 shares only the embedding for ``eagle3``; the engine copies the policy's head into the drafter's
(``rollout/inplace_reload.py``: ``tie_draft_head``; tests/rollout/test_eagle3_ascend.py).

Gradient isolation as for MTP: the auxiliary states, the embedding and the output head are used
detached (:meth:`Eagle3Drafter.forward`, :func:`areal_npu.model.mtp_loss.mtp_loss`). Depths >= 2
attend as vLLM's proposer does (:func:`chained_attention`: depth 1's keys of the prefix, then the
query's own chain), not with the MTP approximation, which trained depth 2 to 0.50 accuracy while
vLLM accepted 0.05 of its second drafts (``scripts/bench_eagle3.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from areal_npu.kernels.packed_attention import packed_attention

__all__ = [
    "Eagle3Config",
    "Eagle3Drafter",
    "capture_aux_states",
    "chained_attention",
    "default_aux_layers",
    "initial_drafter",
    "load_eagle3_drafter",
    "save_eagle3_drafter",
]

#: the architecture name vLLM's registry maps to ``Eagle3LlamaForCausalLM``
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    """The EAGLE-3 drafter co-trained with the policy (served with ``rollout.spec.method: eagle3``)."""

    enabled: bool = False  # train an EAGLE-3 drafter beside the policy; needs rollout.spec.method eagle3
    # residual-stream ids the drafter reads (0 = embeddings, L = after decoder layer L; distinct,
    # ascending); [] = vLLM's default (2, n/2, n-3) where that is 3 distinct ids, else 3 spread ids
    aux_layers: list[int] = field(default_factory=list)
    init_dir: str = ""  # a drafter checkpoint (config.json + model.safetensors) to start from; "" = random
    num_depths: int = 1  # draft steps trained (step d attends as vLLM's d-th draft does; dense, short rows)
    loss_scale: float = 0.1  # the drafter's loss weight: loss_scale / num_depths * sum_d CE_d
    lr_scale: float = 1.0  # the drafter's learning rate relative to the policy's
    init_std: float = 0.02  # random init std of its linear layers

    def validate(self) -> None:
        from areal_npu.config import ConfigError

        if any(b <= a for a, b in zip(self.aux_layers, self.aux_layers[1:])) or any(
            i < 0 for i in self.aux_layers
        ):
            raise ConfigError("aux_layers", f"must be distinct ascending ids >= 0 (vLLM sorts and dedups); got {self.aux_layers}")  # fmt: skip
        if self.num_depths < 1:
            raise ConfigError("num_depths", f"must be >= 1, got {self.num_depths}")
        if not (math.isfinite(self.loss_scale) and self.loss_scale >= 0):
            raise ConfigError("loss_scale", f"must be a finite number >= 0, got {self.loss_scale}")
        if not (math.isfinite(self.lr_scale) and self.lr_scale > 0):
            raise ConfigError("lr_scale", f"must be > 0, got {self.lr_scale}")
        if self.init_std <= 0:
            raise ConfigError("init_std", f"must be > 0, got {self.init_std}")
        if self.init_dir and not (Path(self.init_dir).expanduser() / "config.json").is_file():
            raise ConfigError("init_dir", f"{self.init_dir!r} holds no config.json of an EAGLE-3 drafter")
        default = Eagle3Config()
        for key in (
            "aux_layers",
            "init_dir",
            "num_depths",
            "loss_scale",
            "lr_scale",
            "init_std",
        ):  # none ignored
            if not self.enabled and getattr(self, key) != getattr(default, key):
                raise ConfigError(key, "is read only with eagle3.enabled: true")


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default ``(2, n // 2, n - 3)`` when those are 3 distinct ids in ``[0, n]``, else 3
    ids spread over ``[0, n]`` (a 2-layer model: 0, 1, 2). vLLM dedups ids, so they must differ."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return sorted(ids)
    if num_layers < 2:
        raise ValueError(
            f"EAGLE-3 needs 3 distinct aux layers; a {num_layers}-layer model has {num_layers + 1}"
        )
    return [0, num_layers // 2, num_layers]


def check_aux_layers(layers: list[int], num_layers: int) -> None:
    if not layers or max(layers) > num_layers:
        raise ValueError(
            f"aux layer ids {layers} must lie in [0, {num_layers}] (the policy has {num_layers} layers)"
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotary on ``x`` [T, heads, d] at ``positions`` [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.to(torch.float32)[:, None] * inv[None]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, positions, cu_seqlens, max_seqlen, chain: list | None = None):
        """Attention of one depth; ``chain``: the ``(k, v)`` of the depths before (none at depth 1).
        Returns the output and this depth's ``(k, v)``."""
        t = x.shape[0]
        q = _rope(self.q_proj(x).view(t, self.heads, self.head_dim), positions, self.theta)
        k = _rope(self.k_proj(x).view(t, self.kv_heads, self.head_dim), positions, self.theta)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if chain:
            out = chained_attention(q, chain + [(k, v)], cu_seqlens)
        else:
            out = packed_attention(q, k, v, cu_seqlens, max_seqlen)
        return self.o_proj(out.reshape(t, -1)), (k, v)


def chained_attention(q: torch.Tensor, kv: list, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Depth d >= 2 as vLLM's proposer runs it (EAGLE-3's "training-time test"): the query of index t
    attends to depth 1's keys of indices <= t (the verified prefix in the drafter's KV cache) and
    to its own chain, the keys of depths 2..d at index t. ``kv``: ``(k, v)`` of depths 1..d.
    Dense per segment (O(L^2) scores): exact, for the CPU and short rows; no fused-kernel path yet."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    rep = q.shape[1] // kv[0][0].shape[1]

    def heads(x, a, b):
        return x[a:b].float().repeat_interleave(rep, dim=1)  # [L, Hq, d]

    outs = []
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        qs, k1, v1 = q[a:b].float(), heads(kv[0][0], a, b), heads(kv[0][1], a, b)
        prefix = torch.einsum("ihd,jhd->hij", qs, k1) * scale
        prefix = prefix.masked_fill(
            torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
        own_k = torch.stack([heads(k, a, b) for k, _ in kv[1:]])  # [d-1, L, Hq, d]
        own_v = torch.stack([heads(v, a, b) for _, v in kv[1:]])
        own = torch.einsum("ihd,cihd->hic", qs, own_k) * scale
        p = torch.cat([prefix, own], dim=-1).softmax(-1)
        out = torch.einsum("hij,jhd->ihd", p[..., :n], v1) + torch.einsum("hic,cihd->ihd", p[..., n:], own_v)
        outs.append(out.to(q.dtype))
    return torch.cat(outs)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _Attention(
            h, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope_theta"]
        )
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = _MLP(h, c["intermediate_size"])


class Eagle3Drafter(nn.Module):
    """The drafter's trainable part (see the module docstring); ``config`` is its ``config.json``."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.fc = nn.Linear(n_aux * config["target_hidden_size"], config["hidden_size"], bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    @classmethod
    def for_policy(
        cls, policy_config, cfg: Eagle3Config, generator: torch.Generator | None = None
    ) -> Eagle3Drafter:
        """A new drafter (one layer, the policy's attention shapes) for an HF text ``policy_config``."""
        c = policy_config.get_text_config() if hasattr(policy_config, "get_text_config") else policy_config
        n = c.num_hidden_layers
        layers = list(cfg.aux_layers) or default_aux_layers(n)
        check_aux_layers(layers, n)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        config = {
            "architectures": [VLLM_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "target_hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": c.vocab_size,
            "draft_vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        }
        drafter = cls(config)
        with torch.no_grad():
            for p in drafter.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator) * cfg.init_std)
        return drafter

    def step(self, hidden, embeds, positions, cu_seqlens, max_seqlen, chain: list):
        """One draft depth over a packed row: ``(norm(r), r, (k, v))`` for ``hidden`` = g^(d) [T, H];
        ``chain``: the ``(k, v)`` of the depths before (:func:`chained_attention`)."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        attn, kv = layer.self_attn(x, positions, cu_seqlens, max_seqlen, chain)
        s = hidden + attn
        r = s + layer.mlp(layer.post_attention_layernorm(s))
        return self.norm(r), r, kv

    def forward(
        self,
        aux_states: list[torch.Tensor],
        embed_ids: torch.Tensor,
        position_ids: torch.Tensor,
        embed_weight: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
    ) -> list[torch.Tensor]:
        """Post-norm drafter hidden states of depths 1..D on a packed row of T tokens.

        ``aux_states``: the policy's residual stream at :attr:`aux_layers`, [T, H] each (detached
        here); ``embed_ids`` [D, T]: ``ids_{t+d}`` (:func:`areal_npu.model.mtp_targets.build_mtp_targets`);
        ``position_ids`` [T] restarting per segment; ``embed_weight`` the policy's embedding (detached)."""
        hidden = self.fc(torch.cat([a.detach() for a in aux_states], dim=-1).to(self.fc.weight.dtype))
        positions = position_ids.reshape(-1)
        cu = cu_seqlens.to(device=hidden.device, dtype=torch.int32)
        weight = embed_weight.detach()
        outputs, chain = [], []
        for d in range(embed_ids.shape[0]):
            embeds = F.embedding(embed_ids[d].reshape(-1).to(hidden.device), weight).to(hidden.dtype)
            out, hidden, kv = self.step(hidden, embeds, positions + d, cu, max_seqlen, chain)
            outputs.append(out)
            chain.append(kv)
        return outputs


@contextlib.contextmanager
def capture_aux_states(text_model: nn.Module, layers: list[int]):
    """Within the block, forwards of ``text_model`` (an HF ``*Model`` with ``embed_tokens`` and
    ``layers``) record the residual stream at each id of ``layers`` into the yielded dict
    (id 0: the embedding's output; L: decoder layer L-1's output) -- what vLLM's target hands EAGLE-3."""
    found: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(_module, _args, output):
            found[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = []
    for i in layers:
        module = text_model.embed_tokens if i == 0 else text_model.layers[i - 1]
        handles.append(module.register_forward_hook(keep(i)))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def save_eagle3_drafter(
    drafter: Eagle3Drafter, out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """``config.json`` + ``model.safetensors`` that ``speculative_config={"method": "eagle3", "model": out_dir}`` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to(dtype or p.dtype).contiguous().cpu() for n, p in drafter.named_parameters()}
    config = dict(drafter.config, torch_dtype=str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_eagle3_drafter(path: str | Path) -> Eagle3Drafter:
    from safetensors.torch import load_file

    path = Path(path)
    drafter = Eagle3Drafter(json.loads((path / "config.json").read_text()))
    drafter.load_state_dict(load_file(str(path / "model.safetensors")))
    return drafter


def initial_drafter(policy_dir: str | Path, cfg: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    """The drafter a run starts from: ``cfg.init_dir``'s (checked against the policy's width and
    depth), else a new one for the HF checkpoint ``policy_dir``."""
    from transformers import AutoConfig

    policy = AutoConfig.from_pretrained(policy_dir).get_text_config()
    if not cfg.init_dir:
        return Eagle3Drafter.for_policy(policy, cfg, torch.Generator().manual_seed(seed))
    drafter = load_eagle3_drafter(Path(cfg.init_dir).expanduser())
    if (
        drafter.config["target_hidden_size"] != policy.hidden_size
        or drafter.config["vocab_size"] != policy.vocab_size
    ):
        raise ValueError(
            f"eagle3.init_dir {cfg.init_dir!r} drafts for another model (hidden size or vocabulary differ)"
        )
    check_aux_layers(drafter.aux_layers, policy.num_hidden_layers)
    if cfg.aux_layers and list(cfg.aux_layers) != drafter.aux_layers:
        raise ValueError(f"eagle3.aux_layers {cfg.aux_layers} differ from init_dir's {drafter.aux_layers}")
    return drafter
