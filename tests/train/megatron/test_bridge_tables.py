"""The project's HF <-> Megatron tables (``areal_npu/train/megatron/convert.py``) against
Megatron-Bridge's, on the mappings both have.

Megatron-Bridge cannot be imported here: v0.3.1 (the images' pin, docker/versions.env) requires
``transformers<5`` (this venv has 5.19), and every release with Qwen3.5 (>= 0.5.0) Python 3.12. So
its tables are transcribed below as data, each with its upstream file:line at a tagged commit, and
its fused layouts by the formulas of its mapping classes.

Known differences, each asserted below rather than skipped:

- Spec: Bridge builds Transformer Engine layers, whose pre-norms live inside the next linear
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``, GDN ``in_proj.layer_norm_weight``);
  the engine's local spec has them as ``input_layernorm`` / ``pre_mlp_layernorm`` (:data:`TE_TO_LOCAL`).
- Qwen3.5 zero-centred norms: Bridge sets ``layernorm_zero_centered_gamma`` (qwen35_bridge.py:59)
  and copies ``w``; the engine holds ``1 + w`` in a plain RMSNorm (kinds ``zc``, ``zc_head_norm``).
  The Gated DeltaNet's gated norm: Bridge stores ``w - 1`` in Megatron's zero-centred ``out_norm``;
  the engine keeps transformers' module and ``w`` as is.
- Gated DeltaNet: Bridge targets Megatron-Core's ``GatedDeltaNet`` (``in_proj`` fuses the four
  input projections, ``out_norm``); the engine keeps transformers' layer under
  ``self_attention.gdn.inner`` (same HF tensors, own names).
- Not compared: MTP (the engine's own head, :mod:`areal_npu.train.megatron.mtp`), MoE (refused).
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from areal_npu.train.megatron import convert  # noqa: E402
from areal_npu.train.megatron.shape import gpt_shape  # noqa: E402

# NVIDIA-NeMo/Megatron-Bridge v0.3.1 (9c9dd848966322fc3ed7706747ec13219ef49dda),
# src/megatron/bridge/models/qwen/qwen3_bridge.py:64-97 (Megatron name -> HF name; fused ones apart).
BRIDGE_QWEN3 = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight": "model.layers.*.input_layernorm.weight",
    "decoder.layers.*.mlp.linear_fc1.layer_norm_weight": "model.layers.*.post_attention_layernorm.weight",
    "decoder.layers.*.self_attention.q_layernorm.weight": "model.layers.*.self_attn.q_norm.weight",
    "decoder.layers.*.self_attention.k_layernorm.weight": "model.layers.*.self_attn.k_norm.weight",
    "decoder.layers.*.self_attention.linear_proj.weight": "model.layers.*.self_attn.o_proj.weight",
    "decoder.layers.*.mlp.linear_fc2.weight": "model.layers.*.mlp.down_proj.weight",
}
BRIDGE_QWEN3_FUSED = {  # QKVMapping / GatedMLPMapping, qwen3_bridge.py:86-97
    "decoder.layers.*.self_attention.linear_qkv.weight": tuple(f"model.layers.*.self_attn.{p}_proj.weight" for p in "qkv"),
    "decoder.layers.*.mlp.linear_fc1.weight": ("model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"),
}  # fmt: skip

# v0.5.0 (fcbb6031103d0ca845c1a54d4fee55ecfcca17b6), src/megatron/bridge/models/qwen/qwen35_bridge.py:465-536,
# Qwen35Bridge (qwen3_5_text, dense): the entries beyond Qwen3's; the attention and MLP ones are Qwen3's.
BRIDGE_QWEN35_GDN = {
    "decoder.layers.*.self_attention.in_proj.layer_norm_weight": ("model.layers.*.input_layernorm.weight",),
    "decoder.layers.*.self_attention.out_proj.weight": ("model.layers.*.linear_attn.out_proj.weight",),
    "decoder.layers.*.self_attention.A_log": ("model.layers.*.linear_attn.A_log",),
    "decoder.layers.*.self_attention.dt_bias": ("model.layers.*.linear_attn.dt_bias",),
    "decoder.layers.*.self_attention.conv1d.weight": ("model.layers.*.linear_attn.conv1d.weight",),
    "decoder.layers.*.self_attention.in_proj.weight": tuple(
        f"model.layers.*.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")
    ),
    "decoder.layers.*.self_attention.out_norm.weight": ("model.layers.*.linear_attn.norm.weight",),
}
#: TP split dim of each Megatron tensor, from the module type Bridge's AutoMapping reads
#: (param_mapping.py: column/vocab -> 0, row -> 1; GatedDeltaNet registered "column",
#: qwen35_bridge.py:497); norms are replicated (absent).
BRIDGE_TP_DIM = {
    "embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1,
    "self_attention.out_proj.weight": 1, "self_attention.A_log": 0, "self_attention.dt_bias": 0,
}  # fmt: skip
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
GDN_TO_ENGINE = {"out_proj.weight": "out_proj.weight", "A_log": "A_log", "dt_bias": "dt_bias"}


def _local(mcore: str) -> str:
    for te, local in TE_TO_LOCAL.items():
        mcore = mcore.replace(te, local)
    return mcore


def _ours(shape) -> dict[tuple[str, ...], convert.Rule]:
    return {r.hf: r for r in convert.rules(shape)}


def _qwen3():
    from transformers import Qwen3Config

    return gpt_shape(Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, vocab_size=64, tie_word_embeddings=False))  # fmt: skip


def _qwen35():
    from transformers import Qwen3_5TextConfig

    return gpt_shape(Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=64, tie_word_embeddings=False,
    ))  # fmt: skip


def _expand(table, layers):
    """Bridge's ``*`` patterns, for each layer in ``layers`` (model-level names once)."""
    out = {}
    for mcore, hf in table.items():
        hf = hf if isinstance(hf, tuple) else (hf,)
        for i in layers if "*" in mcore else [None]:
            out[mcore.replace("*", str(i))] = tuple(h.replace("*", str(i)) for h in hf)
    return out


def test_qwen3_names_and_tp_splits_equal_bridges():
    shape = _qwen3()
    ours = _ours(shape)
    bridge = _expand({**BRIDGE_QWEN3, **BRIDGE_QWEN3_FUSED}, range(shape.num_layers))
    assert {h for hf in bridge.values() for h in hf} == set(convert.hf_names(shape))  # same HF coverage
    dims = convert.tp_partition_dims(shape)
    for mcore, hf in bridge.items():
        assert ours[hf].mcore == _local(mcore), hf  # fused members in the same order (q, k, v; gate, up)
        suffix = mcore.split(".", 3)[-1] if mcore.startswith("decoder.layers.") else mcore
        assert dims.get(ours[hf].mcore) == BRIDGE_TP_DIM.get(suffix), mcore


def test_qwen35_shared_mappings_equal_bridges_and_the_differences_are_the_known_ones():
    shape = _qwen35()
    ours = {h: r for r in convert.rules(shape) for h in r.hf}
    gdn_layer, attn_layer = 0, 1
    dims = convert.tp_partition_dims(shape)
    attention = _expand({**BRIDGE_QWEN3, **BRIDGE_QWEN3_FUSED}, [attn_layer])
    for mcore, hf in attention.items():
        if mcore == "output_layer.weight" or "embedding" in mcore:
            assert ours[hf[0]].mcore == mcore and ours[hf[0]].kind == "vocab"
            continue
        assert ours[hf[0]].mcore == _local(mcore), hf
        kind = ours[hf[0]].kind
        if "layernorm" in mcore or "final_layernorm" in mcore:  # Bridge: zero-centred gamma, w copied
            assert kind in ("zc", "zc_head_norm"), (mcore, kind)
        elif mcore.endswith("linear_qkv.weight"):
            assert kind == "gated_qkv"  # attention_output_gate, as Bridge's provider (qwen35_bridge.py:60)
    gdn = _expand(BRIDGE_QWEN35_GDN, [gdn_layer])
    engine_gdn = {h for r in convert.rules(shape) if r.kind.startswith("gdn:") for h in r.hf}
    bridge_gdn = {h for hf in gdn.values() for h in hf if ".linear_attn." in h}
    assert engine_gdn == bridge_gdn  # the same HF tensors of a Gated DeltaNet layer, all of them
    for mcore, hf in gdn.items():
        if mcore.endswith("layer_norm_weight"):
            assert ours[hf[0]].mcore == _local(mcore) and ours[hf[0]].kind == "zc"
            continue
        name = hf[0].split(".linear_attn.")[1]
        assert ours[hf[0]].mcore == f"decoder.layers.{gdn_layer}.self_attention.gdn.inner.{name}"
        leaf = mcore.split(".", 3)[-1]
        if leaf in BRIDGE_TP_DIM:  # out_proj (row), A_log / dt_bias (per value head)
            assert dims[ours[hf[0]].mcore] == BRIDGE_TP_DIM[leaf], mcore
    assert ours["model.layers.0.linear_attn.norm.weight"].kind == "gdn:norm.weight"  # w kept, Bridge w - 1


def _bridge_merge_qkv(q, k, v, heads, groups, d, output_gate):
    """Bridge's ``merge_qkv_weights`` (param_mapping.py:2206-2254 at v0.3.1): per query group
    ``[q heads; (gate heads;) k; v]``, HF's gated ``q_proj`` being per head ``[query; gate]``."""
    hidden = q.shape[-1]
    q = q.view(heads, 2 * d if output_gate else d, hidden)
    if output_gate:
        q, z = torch.chunk(q, 2, dim=1)
    k, v = k.view(groups, d, hidden), v.view(groups, d, hidden)
    per = heads // groups
    parts = []
    for i in range(groups):
        parts += [q[i * per : (i + 1) * per]] + ([z[i * per : (i + 1) * per]] if output_gate else [])
        parts += [k[i : i + 1], v[i : i + 1]]
    return torch.cat(parts).reshape(-1, hidden)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_tp_shards_equal_bridges_merge_and_scatter(hybrid, tp):
    shape = _qwen35() if hybrid else _qwen3()
    g = torch.Generator().manual_seed(0)
    heads, groups, d, hidden = shape.num_heads, shape.num_query_groups, shape.head_dim, shape.hidden_size
    q = torch.randn(heads * d * (2 if hybrid else 1), hidden, generator=g)
    k, v = (torch.randn(groups * d, hidden, generator=g) for _ in range(2))
    gate, up = (torch.randn(shape.ffn_hidden_size, hidden, generator=g) for _ in range(2))
    merged = _bridge_merge_qkv(q, k, v, heads, groups, d, hybrid)
    kind = "gated_qkv" if hybrid else "qkv"
    for r in range(tp):  # Bridge: ColumnParallel scatter of the merged tensor; GatedMLPMapping:
        # gate and up chunked per rank, [gate_r; up_r] (param_mapping.py:2017-2022)
        assert torch.equal(convert.shard(kind, [q, k, v], shape, r, tp), merged.chunk(tp)[r])
        want = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        assert torch.equal(convert.shard("gate_up", [gate, up], shape, r, tp), want)
