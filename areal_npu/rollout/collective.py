"""The collective weight broadcast, both ends: a process group of its own, and buckets as one buffer.

The trainer (rank 0, the sender) and every engine worker (ranks ``1 ..``) build a standalone
process group -- not torch's default group, which the trainer's own ranks and each vLLM engine's
tensor-parallel workers already use -- over a ``TCPStore`` the trainer serves. The backend is the
device family's collective (``platform.py``): ``hccl`` on Ascend, ``nccl`` on CUDA, ``gloo`` on the
CPU; the code path is the same for all three, which is how the CPU tests cover the NPU path.

* The store listens on a socket the trainer binds to the address the plan names (never every
  interface), and its keys live under a random prefix that only reaches the engines through their
  authenticated ``/areal`` routes (the store itself has no authentication).
* A failed sync drops the group (its last reference): destroying a gloo group closes its
  connections, so members blocked in a broadcast fail at once instead of at the timeout -- how the
  engines still alive are released (gloo's ``abort`` does not do that); every member then joins a
  new group for the next try.
* A bucket travels as one ``uint8`` buffer (each tensor's bytes at a 64-byte aligned offset), so a
  bucket is one broadcast whatever its dtypes; the receiver gets the layout (:func:`bucket_layout`)
  over HTTP and cuts the buffer back into named tensors (:func:`unflatten`) without copies.

Device packages are imported only for their backend (``torch_npu`` for ``hccl``, through
``platform.hccl_process_group_class``). Only gloo ran here; nccl and hccl are the same calls with the backend's
own process-group class, and have not run.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

BACKENDS = ("hccl", "nccl", "gloo")
#: transport name (``rollout.weight_transport``) -> torch backend
TRANSPORT_BACKEND = {"hccl": "hccl", "nccl": "nccl", "gloo": "gloo"}
ALIGN = 64

_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool)
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be broadcast as weights")
    return name


def bucket_layout(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``{"nbytes": total, "tensors": [[name, dtype, shape, offset], ...]}``: what the receiver
    needs to cut the flat buffer back into tensors (JSON-ready)."""
    entries, offset = [], 0
    for name, tensor in bucket:
        entries.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset])
        offset += _padded(tensor.numel() * tensor.element_size())
    return {"nbytes": offset, "tensors": entries}


def flatten(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The bucket's bytes as one ``uint8`` tensor on ``device`` (the layout of :func:`bucket_layout`)."""
    layout = bucket_layout(bucket)
    flat = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
    for (_, tensor), (_, _, _, offset) in zip(bucket, layout["tensors"], strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[offset : offset + raw.numel()].copy_(raw)
    return flat


def unflatten(flat: torch.Tensor, layout: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Named views into ``flat`` (no copies), as :func:`bucket_layout` describes them."""
    out = []
    for name, dtype, shape, offset in layout["tensors"]:
        dt = _DTYPES[dtype]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        out.append((name, flat[offset : offset + nbytes].view(dt).reshape(shape)))
    return out


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class GroupInfo:
    """What every member needs to join one weight-broadcast group (sent to engines as JSON)."""

    backend: str
    host: str  # the trainer's address (the store and rank 0)
    port: int
    prefix: str  # the store's key prefix, random per group
    world_size: int
    rank_offset: int  # an engine's first rank (its workers add their own rank)
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)


def listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (a free port), for the trainer's store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1024)
    return sock


def join_group(info: GroupInfo, rank: int, local_addr: str, listen: socket.socket | None = None):
    """This process's member of the group: rank 0 serves the store on ``listen`` (whose file
    descriptor the store takes over), the others connect to it. ``local_addr`` is where the other
    members reach this process. Blocks until every member has joined (or ``timeout_s``)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=info.timeout_s)
    is_master = rank == 0
    fd = listen.detach() if (is_master and listen is not None) else None
    store = dist.TCPStore(
        info.host, info.port, info.world_size, is_master=is_master, timeout=timeout,
        wait_for_workers=False, master_listen_fd=fd, use_libuv=True,
    )  # fmt: skip
    store = dist.PrefixStore(info.prefix, store)
    if info.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_addr)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, info.world_size, opts)
    if info.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, info.world_size, opts)
    if info.backend == "hccl":
        from areal_npu.platform import hccl_process_group_class

        hccl = hccl_process_group_class()  # only on Ascend (the device seam)
        opts = hccl.Options()
        opts._timeout = timeout
        return hccl(store, rank, info.world_size, opts)
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {info.backend!r}")


def broadcast(group, flat: torch.Tensor) -> None:
    """Rank 0's ``flat`` into every member's ``flat`` (same size); blocks until done here."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([flat], opts).wait()
