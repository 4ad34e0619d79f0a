"""torch.distributed set-up for the train engines, through the device seam."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager

import torch.distributed as dist

from areal_npu.platform import current_platform


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(rank: int | None = None, world_size: int | None = None, init_method: str | None = None):
    """Initialise the default process group with the platform's backend (hccl / nccl / gloo).

    Without arguments it reads torchrun's variables, falling back to a one-process group; an
    existing group is reused. Returns ``(rank, world_size)``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if init_method is None:
        if "MASTER_ADDR" in os.environ:
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
    platform = current_platform()
    if platform.device_type != "cpu":
        platform.set_device(int(os.environ.get("LOCAL_RANK", rank)) % max(1, platform.device_count()))
    dist.init_process_group(platform.dist_backend, init_method=init_method, rank=rank, world_size=world_size)
    return rank, world_size


def shutdown_distributed() -> None:
    """Destroy every process group, if any, before the process exits.

    Left to interpreter exit, a gloo group's threads can be destroyed while still joinable and the
    rank aborts ("terminate called without an active exception": seen on CI in a rank that had
    finished its work while its peer was still saving).
    """
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(rank: int | None = None, world_size: int | None = None, init_method: str | None = None):
    """:func:`init_distributed` for the body of a ``with``, :func:`shutdown_distributed` after it."""
    init_distributed(rank, world_size, init_method)
    try:
        yield
    finally:
        shutdown_distributed()


def reduce_floats(values: list[float], op=dist.ReduceOp.SUM, group=None) -> list[float]:
    """``values`` all-reduced with ``op`` over ``group`` (the default group when ``None``), in
    float64; returned as they are without a group or with one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=current_platform().current_device())
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a few floats over ``group`` (identity without one)."""
    return reduce_floats(values, dist.ReduceOp.SUM, group)


def all_reduce_max(values: list[float], group=None) -> list[float]:
    """Element-wise max of a few floats over ``group`` (identity without one)."""
    return reduce_floats(values, dist.ReduceOp.MAX, group)


def all_reduce_flat(tensors: list, group=None) -> None:
    """Sum ``tensors`` in place over ``group`` with one collective."""
    if not tensors:
        return
    import torch

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
