"""torch.distributed set-up for the train engines, through the device seam."""

from __future__ import annotations

import os
import socket

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


def _all_reduce(values: list[float], op) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=current_platform().current_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over the default group (identity without one)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise max of a few floats over the default group (identity without one)."""
    return _all_reduce(values, dist.ReduceOp.MAX)
