"""The tiny Qwen3.5 factory: byte tokenizer, HF checkpoint with mtp.* weights, reload equality."""

import torch
from safetensors import safe_open

from areal_npu.model.tiny import TinyModelConfig, build_tokenizer, save_tiny_model


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

    cfg = TinyModelConfig(
        hidden_size=64, intermediate_size=96, head_dim=16, linear_attention_every=2, num_hidden_layers=2
    )
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
