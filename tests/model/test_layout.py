"""The published Qwen3.5/3.6 checkpoint layout: structure, loading for training, saving back.

References: the structure of the published Qwen3.6-27B checkpoint written out below by hand (from
the published Qwen3.6-27B config, shapes scaled down), transformers' own ``Qwen3_5ForConditionalGeneration``
(its state-dict keys, its ``from_pretrained`` and its forward on text), and vLLM's own name mapping
for the VL class and its ``Qwen3_5MTP`` drafter.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from areal_npu.model.layout import (
    PUBLISHED,
    TEXT,
    detect_layout,
    load_for_training,
    load_model_with_mtp,
    save_model_with_mtp,
)
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model

# Qwen3.6-27B as published: 64 layers = 16 x (3 Gated DeltaNet + 1 full attention),
# hidden 5120, 24 q / 4 kv heads of dim 256, vocab 248320, untied, gated attention output (q_proj
# holds query and gate), partial rotary 0.25, one MTP layer. Scaled: 4 layers, hidden 64, 4 q / 2 kv
# heads of dim 16, vocab 320.
PUBLISHED_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # repeated 16 times in 27B
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "partial_rotary_factor": 0.25,
    },
    "vision_config": {"model_type": "qwen3_5_vision"},
}
SCALED = TinyModelConfig(
    layout="published",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_attention_every=4,
    linear_head_dim=16,
    seed=5,
)
# Weight names of the published checkpoint, as regular expressions over the whole name.
FULL_ATTN = (
    r"model\.language_model\.layers\.3\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight"
)
GDN = (
    r"model\.language_model\.layers\.[012]\.linear_attn\."
    r"(in_proj_qkv\.weight|in_proj_z\.weight|in_proj_b\.weight|in_proj_a\.weight|conv1d\.weight|dt_bias|A_log|norm\.weight|out_proj\.weight)"
)
LAYER_COMMON = r"model\.language_model\.layers\.[0-3]\.(input_layernorm|post_attention_layernorm|mlp\.(gate_proj|up_proj|down_proj))\.weight"
TOP = r"model\.language_model\.(embed_tokens|norm)\.weight|lm_head\.weight"
VISUAL = r"model\.visual\..+"
MTP = (
    r"mtp\.(fc|pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight"
    r"|mtp\.layers\.0\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|mtp\.layers\.0\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight"
    r"|mtp\.layers\.0\.mlp\.(gate_proj|up_proj|down_proj)\.weight"
)
PUBLISHED_NAME = re.compile("|".join(f"(?:{p})" for p in (FULL_ATTN, GDN, LAYER_COMMON, TOP, VISUAL, MTP)))


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("published") / "ckpt", SCALED)


def tensors_of(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def subset_matches(expected: dict, got: dict, where: str = "") -> None:
    for key, value in expected.items():
        assert key in got, f"{where}{key} missing"
        if isinstance(value, dict):
            subset_matches(value, got[key], f"{where}{key}.")
        else:
            assert got[key] == value, f"{where}{key}: {got[key]!r} != {value!r}"


def test_config_nesting_and_weight_names_match_the_published_27b(published):
    config = json.loads((published / "config.json").read_text())
    subset_matches(PUBLISHED_27B, config)
    text = config["text_config"]
    assert "architectures" not in config["text_config"] or not text["architectures"]
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]
    # the vision token ids lie inside the tiny vocabulary
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert 256 < config[key] < text["vocab_size"]
    assert (published / "preprocessor_config.json").is_file()  # vLLM's VL processor reads it

    tensors = tensors_of(published)
    strays = sorted(n for n in tensors if not PUBLISHED_NAME.fullmatch(n))
    assert not strays
    for pattern in (FULL_ATTN, GDN, LAYER_COMMON, TOP, VISUAL, MTP):
        assert any(re.fullmatch(pattern, n) for n in tensors), pattern
    hidden, heads, kv, head_dim = 64, 4, 2, 16
    # gated attention output: q_proj holds the query and its gate
    assert tensors["model.language_model.layers.3.self_attn.q_proj.weight"].shape == (
        2 * heads * head_dim,
        hidden,
    )
    assert tensors["model.language_model.layers.3.self_attn.k_proj.weight"].shape == (kv * head_dim, hidden)
    assert tensors["lm_head.weight"].shape == (320, hidden)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.language_model.embed_tokens.weight"])
    assert tensors["mtp.fc.weight"].shape == (hidden, 2 * hidden)


def test_weight_names_are_transformers_vl_state_dict_plus_mtp(published):
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(published)
    assert type(config).__name__ == "Qwen3_5Config"
    expected = set(Qwen3_5ForConditionalGeneration(config).state_dict())
    names = set(tensors_of(published))
    assert {n for n in names if not n.startswith("mtp.")} == expected
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(published, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]


def test_loads_for_training_as_the_text_model_with_the_vl_forward(published):
    from transformers import Qwen3_5ForConditionalGeneration

    assert detect_layout(published) == PUBLISHED
    lm, head, layout = load_for_training(published, MTPConfig(enabled=True))
    assert type(lm).__name__ == "Qwen3_5ForCausalLM" and layout.kind == PUBLISHED
    assert lm.config is layout.config.text_config
    assert head is not None and head.num_layers == 1
    assert sorted(layout.carried) == sorted(n for n in tensors_of(published) if n.startswith("model.visual."))
    stored = tensors_of(published)
    for name, param in head.named_parameters():
        assert torch.equal(param, stored["mtp." + name])
    reference = Qwen3_5ForConditionalGeneration.from_pretrained(published, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_text_layout_is_detected_and_loads_as_before(tmp_path):
    path = save_tiny_model(
        tmp_path / "text",
        TinyModelConfig(**TEXT_FULL_ATTENTION, hidden_size=64, intermediate_size=96, head_dim=16),
    )
    assert detect_layout(path) == TEXT
    lm, head, layout = load_for_training(path, MTPConfig(enabled=True))
    assert layout.kind == TEXT and layout.checkpoint_name("model.norm.weight") == "model.norm.weight"
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]


def test_text_only_loader_refuses_a_published_checkpoint(published):
    with pytest.raises(ValueError, match="load_for_training"):
        load_model_with_mtp(published, MTPConfig(enabled=True))


def test_saved_back_in_the_published_layout_bit_exactly(published, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    lm, head, layout = load_for_training(published, MTPConfig(enabled=True))
    out = save_model_with_mtp(lm, head, tmp_path / "again", layout=layout)
    before, after = tensors_of(published), tensors_of(out)
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    config = json.loads((out / "config.json").read_text())
    subset_matches(PUBLISHED_27B, config)
    assert (out / "preprocessor_config.json").read_bytes() == (
        published / "preprocessor_config.json"
    ).read_bytes()
    _, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]


def test_export_names_map_into_vllms_vl_model_and_drafter(published):
    """vLLM's own mappers: the VL class takes ``model.language_model.*`` / ``lm_head.*`` /
    ``model.visual.*`` into its ``language_model`` / ``visual`` modules and skips ``mtp.*``; the
    drafter takes ``mtp.*`` (renamed ``model.*``) and the shared embedding."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    mapper = Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper
    lm, head, layout = load_for_training(published, MTPConfig(enabled=True))
    training = [n for n, _ in lm.named_parameters()] + ["mtp." + n for n, _ in head.named_parameters()]
    exported = [layout.checkpoint_name(n) for n in training] + list(layout.carried)
    assert set(exported) == set(tensors_of(published))
    for name in exported:
        mapped = mapper._map_name(name)
        if name.startswith("mtp."):
            assert mapped is None  # the target skips the drafter's weights
        else:
            assert mapped.startswith(("language_model.model.", "language_model.lm_head.", "visual.")), name
    # a text-layout name would not reach the VL class's language model
    assert not mapper._map_name("model.layers.0.mlp.up_proj.weight").startswith("language_model.")


def test_build_tiny_model_gives_the_text_model_of_the_saved_published_checkpoint(published):
    from areal_npu.model.tiny import build_tiny_model

    lm, head, tokenizer = build_tiny_model(SCALED)
    source = tensors_of(published)
    for name, tensor in lm.state_dict().items():
        key = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        assert torch.equal(tensor, source[key]), name
    for name, param in head.named_parameters():
        assert torch.equal(param, source["mtp." + name])
    assert (
        tokenizer.convert_ids_to_tokens(json.loads((published / "config.json").read_text())["image_token_id"])
        == "<|image_pad|>"
    )
