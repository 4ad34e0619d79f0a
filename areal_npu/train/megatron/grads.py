"""Gradient norms and clipping over TP shards, one parameter group at a time.

The engine clips the policy and the MTP head apart (as the FSDP2 engine does): a joint clip would
let the head's gradient rescale the policy's update, breaking the head's isolation from the
backbone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_groups", "sharded_grad_norm"]


def sharded_grad_norm(
    named_grads: Iterable, tp_sharded: set[str], tp_group=None, device=None, pp_group=None, slice_group=None
) -> float:
    """Global L2 norm of the gradients ``(name, grad or None)``: TP-sharded parameters
    (``tp_sharded`` names) summed over ``tp_group``, replicated ones (norms) counted once, and
    every pipeline stage's (``pp_group``: each holds its own layers) summed. ``slice_group``: each
    of its ranks holds a disjoint slice of the gradients (reduce-scattered), summed over it first."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [tp-sharded, replicated]
    for name, grad in named_grads:
        if grad is None:
            continue
        sums[0 if name in tp_sharded else 1] += grad.double().pow(2).sum()
    if slice_group is not None and dist.get_world_size(slice_group) > 1:
        dist.all_reduce(sums, group=slice_group)
    sharded, replicated = sums[0].clone(), sums[1].clone()
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return float(total.sqrt())


def clip_groups(groups: Iterable[tuple[float, Iterable[torch.Tensor]]], clip: float) -> None:
    """Scale each group's gradients (tensors, in place) by ``clip / (norm + 1e-6)`` where its ``norm`` exceeds ``clip``
    (``torch.nn.utils.clip_grad_norm_``'s coefficient); ``clip <= 0``: no clipping."""
    if clip <= 0:
        return
    for norm, grads in groups:
        if norm > clip:
            scale = clip / (norm + 1e-6)
            for grad in grads:
                grad.mul_(scale)
