"""Read the ``mtp.*`` weights that transformers' Qwen3.5 classes drop, and attach the head to a model.

``Qwen3_5ForCausalLM._keys_to_ignore_on_load_unexpected = ["^mtp.*"]``: ``from_pretrained``
silently skips the head and ``save_pretrained`` never writes it. Here the head is read straight
from the checkpoint's safetensors, in the layout vLLM's ``Qwen3_5MTP`` drafter loads (``mtp.*``
names; ``config.mtp_num_hidden_layers``). Whole checkpoints (policy and head, either layout) are
loaded and saved in :mod:`areal_npu.model.layout`, which builds on this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights
from areal_npu.names import MTP_PREFIX

__all__ = [
    "INDEX_NAME",
    "MTP_SHARD_NAME",
    "attach_mtp",
    "build_mtp_head",
    "load_mtp_state",
    "read_mtp_tensors",
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
    if not cfg.enabled:
        return None
    ref = model.get_input_embeddings().weight
    # a Qwen3.5 VLM keeps the text shapes in text_config
    return build_mtp_head(model.config.get_text_config(), cfg, checkpoint_dir, ref.dtype, ref.device)


def build_mtp_head(
    config, cfg: MTPConfig, checkpoint_dir=None, dtype=torch.float32, device="cpu"
) -> Qwen35MTP:
    """:func:`attach_mtp` from the text config alone (no policy model needed): the head, with its
    ``mtp.*`` weights read from ``checkpoint_dir`` or new (``cfg.init_new_head``)."""
    tensors = read_mtp_tensors(checkpoint_dir) if checkpoint_dir is not None else {}
    found = _infer_num_layers(tensors)
    num_layers = cfg.num_layers or found or int(getattr(config, "mtp_num_hidden_layers", 0) or 1)
    mtp = Qwen35MTP(config, num_layers).to(device=device, dtype=dtype)
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
