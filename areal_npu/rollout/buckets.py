"""The wire format of a weight bucket, and which tensors go to the drafter.

A bucket (a list of ``(name, tensor)``, sized by :func:`areal_npu.data.buckets.iter_buckets`) travels
as safetensors bytes: no pickle of tensors; names and dtypes survive exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from areal_npu.names import MTP_PREFIX


def split_policy_and_draft(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Checkpoint names ``mtp.*`` belong to the MTP drafter (a separate module in vLLM); the rest to the policy."""
    policy, draft = [], []
    for name, tensor in named_tensors:
        (draft if name.startswith(MTP_PREFIX) else policy).append((name, tensor))
    return policy, draft


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in bucket})


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(payload).items())
