"""Hugging Face Qwen3 <-> Megatron-Core ``GPTModel`` weights: an explicit name and layout table.

On the Ascend images Megatron-Bridge (pinned to a commit that supports core 0.16) is the intended
converter: it knows every model family and streams weights without holding a full copy. It is not
used here because megatron-bridge 0.3.1 (the newest for Python 3.11) requires ``transformers<5``,
Transformer Engine (CUDA 13 wheels) and ``mamba-ssm``, none of which install on a CPU machine with
transformers 5; Qwen3.5 text arrives in Bridge 0.5.0, which needs Python 3.12 (version table in
docker/versions.env). ``tests/train/megatron/test_bridge_tables.py`` compares these tables with
Bridge's (v0.3.1 Qwen3, v0.5.0 Qwen3.5, transcribed) on the mappings both have. This table covers Qwen3 dense, the model the CPU tests build, and is verified
independently: the Megatron model's logits on a packed batch equal transformers' per sequence, and
an export loads back into transformers with the same logits (``tests/train/megatron``).

Per decoder layer ``i`` (``H`` hidden, ``G`` query groups = KV heads, ``Hq`` query heads, ``d`` head
dim, ``F`` FFN size; Megatron names under ``decoder.layers.{i}.``):

=========================================  ==========================================  ===========
HF                                         Megatron                                    TP split
=========================================  ==========================================  ===========
``input_layernorm.weight``                 ``input_layernorm.weight``                  replicated
``self_attn.{q,k,v}_proj.weight``          ``self_attention.linear_qkv.weight``        dim 0
``self_attn.q_norm.weight``                ``self_attention.q_layernorm.weight``       repl. (*)
``self_attn.k_norm.weight``                ``self_attention.k_layernorm.weight``       repl. (*)
``self_attn.o_proj.weight``                ``self_attention.linear_proj.weight``       dim 1
``post_attention_layernorm.weight``        ``pre_mlp_layernorm.weight``                replicated
``mlp.{gate,up}_proj.weight``              ``mlp.linear_fc1.weight``                   dim 0
``mlp.down_proj.weight``                   ``mlp.linear_fc2.weight``                   dim 1
=========================================  ==========================================  ===========

(*) per-head norms: every TP rank holds the whole weight but applies it to its own heads only, so
its gradient is a partial sum that must be all-reduced over TP (Megatron's
``finalize_model_grads`` does the same for ``q_layernorm`` / ``k_layernorm``).

plus ``model.embed_tokens.weight`` -> ``embedding.word_embeddings.weight`` (vocab, dim 0),
``model.norm.weight`` -> ``decoder.final_layernorm.weight``, ``lm_head.weight`` ->
``output_layer.weight`` (vocab, dim 0; absent with tied embeddings).

Pipeline stages (:class:`Stage`): stage ``p`` of ``pp`` holds layers ``p L/pp .. (p+1) L/pp - 1``
under *local* Megatron indices (``decoder.layers.0`` is its first layer, as Megatron-Core names
them), the embedding on the first stage, the final norm and the output layer on the last.

Fused layouts:

- ``linear_qkv`` interleaves per query group: ``[G, (Hq/G + 2) d, H]`` = for each group ``g``, its
  ``Hq/G`` query heads, then its key head, then its value head. TP rank ``r`` holds the contiguous
  groups ``r G/tp .. (r+1) G/tp - 1``, so a shard is a contiguous slice of the fused tensor.
  With fewer KV heads than TP ranks (``tp`` a multiple of ``G``) the shards are *still* the ``tp``
  contiguous row slices of the fused tensor (a slice may cut through a group's q/k/v): Megatron-Core
  0.16.1 replicates KV heads in compute, not in the weights -- ``SelfAttention`` all-gathers the QKV
  output over TP and each rank keeps its group's key/value and its ``Hq/tp`` query heads. So the
  same :func:`shard` / :func:`unshard` hold, and the export concatenates the slices (no copy to pick).
- ``linear_fc1`` is ``[gate; up]`` *per TP shard*: rank ``r`` holds ``[gate_r; up_r]`` (Megatron's
  SwiGLU splits its local output in two halves), so the shards concatenated are
  ``[gate_0; up_0; gate_1; up_1; ...]``, not ``[gate; up]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_npu.train.megatron.shape import GPTShape

__all__ = [
    "ALL",
    "LAYER_TABLE",
    "MODEL_TABLE",
    "Stage",
    "hf_names",
    "hf_shape",
    "hf_to_mcore",
    "mcore_to_hf",
    "shard",
    "tp_partial_grad_names",
    "tp_partition_dims",
]


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # HF names (several for fused tensors), "{i}" = layer index
    mcore: str  # Megatron name
    kind: str  # replicated | head_norm | column | row | vocab | qkv | gate_up


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``rank`` of ``size`` (layers split evenly, checked by ``check_layout``)."""

    rank: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The global indices of this stage's decoder layers."""
        per = num_layers // self.size
        return range(self.rank * per, (self.rank + 1) * per)


ALL = Stage()

#: Kinds whose weight every TP rank holds whole. ``zc`` / ``zc_head_norm``: Qwen3.5's zero-centred
#: norms (``(1 + w) x / rms(x)``), held by Megatron's plain RMSNorm as ``1 + w``; ``gdn:<name>``: a
#: Gated DeltaNet tensor (:mod:`.gdn`), of which only the gated norm is replicated.
REPLICATED = ("replicated", "head_norm", "zc", "zc_head_norm", "gdn:norm.weight")
#: Replicated kinds whose gradient is a partial sum over TP ranks (each rank applies them to its heads).
TP_PARTIAL_KINDS = ("head_norm", "zc_head_norm", "gdn:norm.weight")
#: Qwen3.5's full-attention layer: zero-centred norms, the query projection carrying an output gate.
ZERO_CENTRED = {"replicated": "zc", "head_norm": "zc_head_norm", "qkv": "gated_qkv"}
#: A Gated DeltaNet layer's tensors (HF ``linear_attn.<name>`` -> Megatron ``self_attention.gdn.inner.<name>``).
GDN_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
               "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")  # fmt: skip


LAYER_TABLE: tuple[Rule, ...] = (
    Rule(("model.layers.{i}.input_layernorm.weight",), "decoder.layers.{i}.input_layernorm.weight", "replicated"),
    Rule(
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
        "decoder.layers.{i}.self_attention.linear_qkv.weight",
        "qkv",
    ),
    Rule(("model.layers.{i}.self_attn.q_norm.weight",), "decoder.layers.{i}.self_attention.q_layernorm.weight", "head_norm"),
    Rule(("model.layers.{i}.self_attn.k_norm.weight",), "decoder.layers.{i}.self_attention.k_layernorm.weight", "head_norm"),
    Rule(("model.layers.{i}.self_attn.o_proj.weight",), "decoder.layers.{i}.self_attention.linear_proj.weight", "row"),
    Rule(("model.layers.{i}.post_attention_layernorm.weight",), "decoder.layers.{i}.pre_mlp_layernorm.weight", "replicated"),
    Rule(
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        "gate_up",
    ),
    Rule(("model.layers.{i}.mlp.down_proj.weight",), "decoder.layers.{i}.mlp.linear_fc2.weight", "row"),
)  # fmt: skip

MODEL_TABLE: tuple[Rule, ...] = (
    Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", "vocab"),
    Rule(("model.norm.weight",), "decoder.final_layernorm.weight", "replicated"),
    Rule(("lm_head.weight",), "output_layer.weight", "vocab"),
)


def _layer_table(shape: GPTShape, i: int) -> list[Rule]:
    """Layer ``i``'s rules: Qwen3's, or a Qwen3.5 full-attention / Gated DeltaNet layer's."""
    if not shape.hybrid:
        return list(LAYER_TABLE)
    table = [Rule(r.hf, r.mcore, ZERO_CENTRED.get(r.kind, r.kind)) for r in LAYER_TABLE]
    if shape.layer_types[i] == "full_attention":
        return table
    keep = [r for r in table if ".self_attn." not in r.hf[0]]  # norms and the MLP
    return keep + [
        Rule((f"model.layers.{{i}}.linear_attn.{n}",), f"decoder.layers.{{i}}.self_attention.gdn.inner.{n}", f"gdn:{n}")
        for n in GDN_TENSORS
    ]  # fmt: skip


def rules(shape: GPTShape, stage: Stage = ALL) -> list[Rule]:
    """Every rule of this model (of ``stage``: its layers, HF names with the global index, Megatron
    names with the local one), in HF order; no ``lm_head`` when tied."""
    model = {r.mcore: r for r in MODEL_TABLE}
    if shape.hybrid:
        norm = model["decoder.final_layernorm.weight"]
        model[norm.mcore] = Rule(norm.hf, norm.mcore, "zc")
    out = [model["embedding.word_embeddings.weight"]] if stage.first else []
    layers = stage.layers(shape.num_layers)
    for i in layers:
        out += [
            Rule(tuple(h.format(i=i) for h in r.hf), r.mcore.format(i=i - layers.start), r.kind)
            for r in _layer_table(shape, i)
        ]
    if stage.last:
        out.append(model["decoder.final_layernorm.weight"])
        if not shape.tie_word_embeddings:
            out.append(model["output_layer.weight"])
    return out


def tp_partition_dims(shape: GPTShape, stage: Stage = ALL) -> dict[str, int]:
    """Megatron name -> the dim its TP shards split (replicated weights are absent)."""
    dims = {"column": 0, "vocab": 0, "qkv": 0, "gated_qkv": 0, "gate_up": 0, "row": 1, "gdn:out_proj.weight": 1}
    return {r.mcore: dims.get(r.kind, 0) for r in rules(shape, stage) if r.kind not in REPLICATED}


def tp_partial_grad_names(shape: GPTShape, stage: Stage = ALL) -> list[str]:
    """Replicated weights whose gradients are partial over TP ranks (the per-head q/k norms)."""
    return [r.mcore for r in rules(shape, stage) if r.kind in TP_PARTIAL_KINDS]


def hf_names(shape: GPTShape) -> list[str]:
    return [h for r in rules(shape) for h in r.hf]


def hf_shape(name: str, shape: GPTShape) -> tuple[int, ...]:
    """The full shape of HF tensor ``name`` (what a pipeline stage that does not hold it receives)."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    suffixes = {
        "embed_tokens.weight": (shape.vocab_size, h),
        "lm_head.weight": (shape.vocab_size, h),
        "norm.weight": (h,),
        "layernorm.weight": (h,),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "q_proj.weight": (shape.num_heads * d, h),
        "k_proj.weight": (shape.num_query_groups * d, h),
        "v_proj.weight": (shape.num_query_groups * d, h),
        "o_proj.weight": (h, shape.num_heads * d),
        **_gdn_shapes(shape),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
    }
    if shape.hybrid:  # the query projection carries a gate per head
        suffixes["q_proj.weight"] = (2 * shape.num_heads * d, h)
    for suffix in sorted(suffixes, key=len, reverse=True):  # q_norm before norm
        if name.endswith(suffix):
            return suffixes[suffix]
    raise KeyError(f"no shape known for HF tensor {name!r}")


def _gdn_config(shape: GPTShape):
    from types import SimpleNamespace

    hk, dk, hv, dv, _ = shape.linear_dims
    return SimpleNamespace(linear_num_key_heads=hk, linear_key_head_dim=dk, linear_num_value_heads=hv,
                           linear_value_head_dim=dv)  # fmt: skip


def _gdn_shapes(shape: GPTShape) -> dict[str, tuple[int, ...]]:
    if not shape.hybrid:
        return {}
    hk, dk, hv, dv, kernel = shape.linear_dims
    h, channels = shape.hidden_size, 2 * hk * dk + hv * dv
    return {
        "linear_attn.in_proj_qkv.weight": (channels, h),
        "linear_attn.in_proj_z.weight": (hv * dv, h),
        "linear_attn.in_proj_b.weight": (hv, h),
        "linear_attn.in_proj_a.weight": (hv, h),
        "linear_attn.conv1d.weight": (channels, 1, kernel),
        "linear_attn.A_log": (hv,),
        "linear_attn.dt_bias": (hv,),
        "linear_attn.norm.weight": (dv,),
        "linear_attn.out_proj.weight": (h, hv * dv),
    }


# ---- full tensors <-> the fused Megatron layout (tp = 1) ---------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: GPTShape) -> torch.Tensor:
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_heads // g
    hidden = q.shape[-1]
    fused = torch.cat([q.view(g, per * d, hidden), k.view(g, d, hidden), v.view(g, d, hidden)], dim=1)
    return fused.reshape(g * (per + 2) * d, hidden)


def split_qkv(fused: torch.Tensor, shape: GPTShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_heads // g
    hidden = fused.shape[-1]
    q, k, v = fused.view(g, (per + 2) * d, hidden).split([per * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def fuse_gated_qkv(q, k, v, shape: GPTShape) -> torch.Tensor:
    """Megatron's ``linear_qkv`` with ``attention_output_gate``: per query group ``[q; gate; k; v]``
    from HF's ``q_proj`` (per head ``[query (d); gate (d)]``), ``k_proj`` and ``v_proj``."""
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_heads // g
    hidden = q.shape[-1]
    q_and_gate = q.view(g, per, 2, d, hidden)
    fused = [q_and_gate[:, :, 0].reshape(g, per * d, hidden), q_and_gate[:, :, 1].reshape(g, per * d, hidden)]
    return torch.cat(fused + [k.view(g, d, hidden), v.view(g, d, hidden)], dim=1).reshape(-1, hidden)


def split_gated_qkv(fused, shape: GPTShape):
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_heads // g
    hidden = fused.shape[-1]
    q, gate, k, v = fused.view(g, (2 * per + 2) * d, hidden).split([per * d, per * d, d, d], dim=1)
    q_and_gate = torch.stack([q.view(g, per, d, hidden), gate.view(g, per, d, hidden)], dim=2)
    return q_and_gate.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def shard(rule_kind: str, tensors: Sequence[torch.Tensor], shape: GPTShape, tp_rank: int, tp_size: int):
    """This TP rank's Megatron tensor from the full HF tensor(s) of one rule."""
    if rule_kind in ("zc", "zc_head_norm"):
        return 1.0 + tensors[0].float()
    if rule_kind == "gated_qkv":
        return fuse_gated_qkv(*tensors, shape).chunk(tp_size, dim=0)[tp_rank]
    if rule_kind.startswith("gdn:"):
        from areal_npu.train.megatron.gdn import shard_gdn

        name = rule_kind[len("gdn:") :]
        return shard_gdn({name: tensors[0]}, _gdn_config(shape), tp_rank, tp_size)[name]
    if rule_kind in REPLICATED:
        return tensors[0]
    if rule_kind in ("column", "vocab"):
        return tensors[0].chunk(tp_size, dim=0)[tp_rank]
    if rule_kind == "row":
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if rule_kind == "qkv":
        return fuse_qkv(*tensors, shape).chunk(tp_size, dim=0)[tp_rank]  # contiguous query groups
    if rule_kind == "gate_up":
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown rule kind {rule_kind!r}")


def unshard(
    rule_kind: str, shards: Sequence[torch.Tensor], shape: GPTShape, grads: bool = False
) -> list[torch.Tensor]:
    """The full HF tensor(s) of one rule from every TP rank's Megatron shard (rank order).
    ``grads``: the tensors are gradients (a zero-centred norm's gradient w.r.t. ``w`` is the one
    w.r.t. ``1 + w``: no shift)."""
    if rule_kind in ("zc", "zc_head_norm"):
        return [shards[0] if grads else shards[0] - 1.0]
    if rule_kind == "gated_qkv":
        return list(split_gated_qkv(torch.cat(list(shards), dim=0), shape))
    if rule_kind.startswith("gdn:"):
        from areal_npu.train.megatron.gdn import unshard_gdn

        name = rule_kind[len("gdn:") :]
        return [unshard_gdn([{name: s} for s in shards], _gdn_config(shape))[name]]
    if rule_kind in REPLICATED:
        return [shards[0]]
    if rule_kind in ("column", "vocab"):
        return [torch.cat(list(shards), dim=0)]
    if rule_kind == "row":
        return [torch.cat(list(shards), dim=1)]
    if rule_kind == "qkv":
        return list(split_qkv(torch.cat(list(shards), dim=0), shape))
    if rule_kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown rule kind {rule_kind!r}")


# ---- whole state dicts --------------------------------------------------------------------------
def hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor],
    shape: GPTShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    stage: Stage = ALL,
) -> dict[str, torch.Tensor]:
    """This TP rank's (and pipeline stage's) Megatron state dict from a full HF state dict; every HF
    tensor is used once by some stage (an unknown or missing name is an error naming it)."""
    out = {}
    used = set(hf_names(shape)) - {h for r in rules(shape, stage) for h in r.hf}  # other stages'
    for rule in rules(shape, stage):
        missing = [h for h in rule.hf if h not in hf_state]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (for {rule.mcore})")
        out[rule.mcore] = shard(
            rule.kind, [hf_state[h] for h in rule.hf], shape, tp_rank, tp_size
        ).contiguous()
        used.update(rule.hf)
    unknown = sorted(n for n in hf_state if n not in used and not _ignored(n, shape))
    if unknown:
        raise KeyError(
            f"HF tensors with no Megatron counterpart: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    return out


def _ignored(name: str, shape: GPTShape) -> bool:
    # a tied checkpoint may still carry lm_head; rotary buffers are not weights
    return (shape.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")


def mcore_to_hf(
    tp_shards: Sequence[Mapping[str, torch.Tensor]], shape: GPTShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) from every TP rank's Megatron state dict (list in TP rank order)."""
    for rule in rules(shape):
        tensors = unshard(rule.kind, [s[rule.mcore] for s in tp_shards], shape)
        yield from zip(rule.hf, tensors)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def gathered_hf_tensors(
    named_params: Mapping[str, torch.Tensor], shape: GPTShape, tp_group=None, pp_group=None, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor) for every weight, one rule at a time, on every rank: shards are
    all-gathered over ``tp_group`` and, with pipeline stages (``pp_group``), broadcast from the stage
    that holds them (collective: every rank iterates), so at most one full tensor (or fused group)
    exists beyond the model at a time. Each tensor is a copy (a later optimizer step or gradient
    clipping does not change what was yielded)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    pp = dist.get_world_size(pp_group) if pp_group is not None and dist.is_initialized() else 1
    here = Stage(dist.get_rank(pp_group), pp) if pp > 1 else ALL
    local_rules = {r.hf: r for r in rules(shape, here)}
    dtype = next(iter(named_params.values())).dtype
    for owner in range(pp):
        for rule in rules(shape, Stage(owner, pp)):
            if owner == here.rank:
                local = named_params[local_rules[rule.hf].mcore].detach()
                if rule.kind in REPLICATED or tp == 1:
                    shards = [local]
                else:
                    shards = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
                tensors = [t.contiguous() for t in unshard(rule.kind, shards, shape, grads)]
            else:
                device = next(iter(named_params.values())).device
                tensors = [torch.empty(hf_shape(h, shape), dtype=dtype, device=device) for h in rule.hf]
            if pp > 1:
                src = dist.get_global_rank(pp_group, owner)
                for tensor in tensors:
                    dist.broadcast(tensor, src, group=pp_group)
            for name, tensor in zip(rule.hf, tensors):  # a copy: not a view of live grads/params
                yield name, tensor.to("cpu", copy=True).contiguous()
