"""The FSDP2 engine's model without a full copy on any rank: built on the meta device, sharded,
then each rank's DTensor shard (its rows of every parameter, FSDP2's ``Shard(0)``) read from the
checkpoint (:class:`areal_npu.model.safetensors_reader.SafetensorsReader`) straight into it.

What is not in the checkpoint is made here: the rotary tables (non-persistent buffers, rebuilt from
the config) and the MTP head's tensors when it is new (built for real before sharding, one layer,
and copied into its shards after).
"""

from __future__ import annotations

import torch
from torch import nn

from areal_npu.names import MTP_PREFIX

__all__ = ["materialise", "meta_text_model"]


def meta_text_model(hf_config) -> nn.Module:
    """The text causal LM of ``hf_config`` with every parameter and buffer on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _local_rows(param) -> tuple[slice, torch.Tensor]:
    """(rows of the full tensor, local tensor) of an FSDP2 parameter (``Shard(0)``, torch.chunk's split)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return slice(None), param
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected FSDP2's Shard(0), got {param.placements}")
    local = param.to_local()
    n, world = param.shape[0], param.device_mesh.size()
    per = -(-n // world)
    start = min(n, param.device_mesh.get_local_rank() * per)
    if local.shape[0] != min(per, n - start):
        raise ValueError(f"unexpected local shard {tuple(local.shape)} of {tuple(param.shape)}")
    return slice(start, start + local.shape[0]), local


def materialise(module: nn.Module, reader, layout, kept: dict[str, torch.Tensor], device) -> None:
    """Allocate the sharded meta ``module`` (``PolicyWithMTP``) on ``device`` and fill every
    parameter: ``kept`` (full tensors by name, the new MTP head) or the checkpoint, each rank its
    rows only; rebuild the rotary buffers."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            rows, local = _local_rows(param)
            if local.numel() == 0:
                continue
            if name in kept:
                local.copy_(kept[name][rows])
                continue
            if not name.startswith("lm.") and not name.startswith(MTP_PREFIX):
                raise KeyError(f"{name}: neither the policy's nor the MTP head's")
            source = layout.checkpoint_name(name[len("lm.") :]) if name.startswith("lm.") else name
            if source not in reader:
                raise KeyError(f"HF checkpoint lacks {source} (for {name})")
            if reader.shape(source) != tuple(param.shape):
                raise ValueError(f"{source}: checkpoint {reader.shape(source)}, model {tuple(param.shape)}")
            if reader.dtype(source) == local.dtype and local.is_contiguous() and local.device.type == "cpu":
                reader.read(source, rows, out=local)
            else:
                local.copy_(reader.read(source, rows))
    with torch.no_grad():  # non-persistent buffers: only rotary tables, recomputed from the config
        for name, child in module.named_modules():
            own = dict(child.named_buffers(recurse=False))
            if not own:
                continue
            if not type(child).__name__.endswith("RotaryEmbedding"):
                raise ValueError(f"{name}: buffers {sorted(own)} that no checkpoint holds")
            fresh = type(child)(config=child.config)
            for buffer_name, value in fresh.named_buffers(recurse=False):
                own[buffer_name].copy_(value)
