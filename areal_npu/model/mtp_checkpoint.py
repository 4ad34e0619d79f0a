"""Load and save the ``mtp.*`` weights that transformers' Qwen3.5 classes drop.

``Qwen3_5ForCausalLM._keys_to_ignore_on_load_unexpected = ["^mtp.*"]``: ``from_pretrained``
silently skips the head and ``save_pretrained`` never writes it. Here the head is read straight
from the checkpoint's safetensors and written back next to the model's weights, in the layout vLLM's
``Qwen3_5MTP`` drafter loads (``mtp.*`` names; ``config.mtp_num_hidden_layers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_npu.model.mtp import MTP_PREFIX, MTPConfig, Qwen35MTP, init_mtp_weights, mtp_state_dict

__all__ = [
    "MTP_SHARD_NAME",
    "attach_mtp",
    "load_mtp_state",
    "load_model_with_mtp",
    "read_mtp_tensors",
    "save_model_with_mtp",
]

MTP_SHARD_NAME = "model-mtp.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_mtp_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor in the checkpoint's safetensors files (empty dict if none)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for n, f in weight_map.items() if n.startswith(MTP_PREFIX)})
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    tensors = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                if key.startswith(MTP_PREFIX):
                    tensors[key] = f.get_tensor(key)
    return tensors


def load_mtp_state(mtp: Qwen35MTP, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``mtp.*`` tensors into ``mtp``; every parameter must be present with its exact shape."""
    expected = dict(mtp.named_parameters())
    got = {k[len(MTP_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MTP_PREFIX)}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"MTP checkpoint does not match the head ({mtp.num_layers} layer(s)): "
            f"missing {[MTP_PREFIX + n for n in missing]}, unexpected {[MTP_PREFIX + n for n in unexpected]}"
        )
    for name, param in expected.items():
        if tuple(got[name].shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch for {MTP_PREFIX}{name}: checkpoint {tuple(got[name].shape)}, "
                f"model expects {tuple(param.shape)}"
            )
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(got[name].to(dtype=param.dtype, device=param.device))


def _infer_num_layers(tensors: dict[str, torch.Tensor]) -> int:
    idx = {int(k.split(".")[2]) for k in tensors if k.startswith(MTP_PREFIX + "layers.")}
    return max(idx) + 1 if idx else 0


def attach_mtp(model, cfg: MTPConfig, checkpoint_dir: str | Path | None = None) -> Qwen35MTP | None:
    """Build the head for ``model`` (Qwen3.5 or Qwen3 text), restoring ``mtp.*`` from
    ``checkpoint_dir``. Without those weights it fails unless ``cfg.init_new_head``."""
    cfg.validate()
    if not cfg.enabled:
        return None
    tensors = read_mtp_tensors(checkpoint_dir) if checkpoint_dir is not None else {}
    config = model.config.get_text_config()  # a Qwen3.5 VLM keeps the text shapes in text_config
    found = _infer_num_layers(tensors)
    num_layers = cfg.num_layers or found or int(getattr(config, "mtp_num_hidden_layers", 0) or 1)
    ref = model.get_input_embeddings().weight
    mtp = Qwen35MTP(config, num_layers).to(device=ref.device, dtype=ref.dtype)
    if tensors:
        load_mtp_state(mtp, tensors)
    elif cfg.init_new_head:
        std = cfg.init_std or float(getattr(config, "initializer_range", 0.02))
        init_mtp_weights(mtp, std=std)
    else:
        where = f"checkpoint {str(checkpoint_dir)!r}" if checkpoint_dir is not None else "no checkpoint given"
        raise ValueError(
            f"MTP head requested but {where} has no mtp.* weights; set mtp.init_new_head=true to start "
            "from a randomly initialised head (then warm it up before speculative rollouts)"
        )
    config.mtp_num_hidden_layers = num_layers
    return mtp


def load_model_with_mtp(model_dir: str | Path, cfg: MTPConfig, dtype: torch.dtype = torch.float32, **kwargs):
    """``(model, mtp or None)``: transformers for the policy, :func:`attach_mtp` for the head.
    Text-layout checkpoints only: a published (multimodal) one loads with
    :func:`areal_npu.model.layout.load_for_training`, which also returns the layout to save it in."""
    from transformers import AutoModelForCausalLM

    from areal_npu.model.layout import PUBLISHED, detect_layout

    if detect_layout(model_dir) == PUBLISHED:
        raise ValueError(
            f"{model_dir} is a published (multimodal) Qwen3.5 checkpoint: load it with "
            "areal_npu.model.layout.load_for_training, so that saves keep its layout"
        )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs)
    return model, attach_mtp(model, cfg, model_dir)


def save_model_with_mtp(
    model, mtp: Qwen35MTP | None, out_dir: str | Path, tokenizer=None, layout=None
) -> Path:
    """``save_pretrained`` plus the ``mtp.*`` weights: merged into a single ``model.safetensors``,
    or as ``model-mtp.safetensors`` listed in the shard index. Sets ``mtp_num_hidden_layers``.
    With a published ``layout`` (from :func:`areal_npu.model.layout.load_for_training`) the text
    model is written back into that layout instead (one ``model.safetensors``)."""
    from safetensors.torch import load_file, save_file

    from areal_npu.model.layout import PUBLISHED

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if mtp is not None:
        model.config.get_text_config().mtp_num_hidden_layers = mtp.num_layers
    if layout is not None and layout.kind == PUBLISHED:
        named = [(k, v.detach().to("cpu")) for k, v in model.state_dict().items()]
        named += [(k, v.to("cpu")) for k, v in (mtp_state_dict(mtp) if mtp is not None else {}).items()]
        return layout.save(out, named, model.config, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if mtp is None:
        return out
    head = {k: v.to("cpu") for k, v in mtp_state_dict(mtp).items()}
    index = out / INDEX_NAME
    if index.is_file():
        data = json.loads(index.read_text())
        save_file(head, str(out / MTP_SHARD_NAME), metadata={"format": "pt"})
        data["weight_map"].update({k: MTP_SHARD_NAME for k in head})
        index.write_text(json.dumps(data, indent=2, sort_keys=True))
    else:
        single = out / "model.safetensors"
        tensors = load_file(str(single))
        tensors.update(head)
        save_file(tensors, str(single), metadata={"format": "pt"})
    return out
