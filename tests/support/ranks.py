"""Rank processes for the multi-process tests, forked from a server that imported the heavy modules once.

``spawn`` starts every rank as a new interpreter that imports torch, transformers and Megatron-Core
again: ~10 s of CPU per rank, about 70 ranks in the suite, on 2 cores. ``forkserver`` forks each rank
from one server process per test session, which imports them once (``set_forkserver_preload``; a
module that does not import is skipped). The server runs nothing but those imports -- no thread, no
process group, no device -- so each forked rank starts as clean as a spawned one. Its environment is
the server's, taken when the first test started it: these tests pass everything to their ranks as
arguments.
"""

from __future__ import annotations

import multiprocessing

import torch.multiprocessing as mp

PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "transformers",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_5.modeling_qwen3_5",
    "megatron.core", "megatron.core.models.gpt", "areal_npu.train.megatron.engine", "areal_npu.train.fsdp2",
]  # fmt: skip


def start_processes(fn, args: tuple, nprocs: int, join: bool = True):
    """``torch.multiprocessing.start_processes`` with ``forkserver`` ranks (see the module docstring)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def run_ranks(fn, args: tuple, nprocs: int, timeout_s: float = 300) -> list[int]:
    """:func:`start_processes` without joining: waits up to ``timeout_s`` for each rank, kills any left
    running (a rank waiting for one that stopped fails the test instead of hanging CI) and returns
    the exit codes."""
    context = start_processes(fn, args=args, nprocs=nprocs, join=False)
    for proc in context.processes:
        proc.join(timeout_s)
    alive = [p.pid for p in context.processes if p.is_alive()]
    for proc in context.processes:
        if proc.is_alive():
            proc.kill()
    assert not alive, f"rank processes {alive} still running: a rank waits for one that stopped"
    return [p.exitcode for p in context.processes]


def optim_writers(step) -> dict[str, set[int]]:
    """The ranks that wrote each optimizer state of a Megatron checkpoint (DCP files ``__<rank>_<n>.distcp``)."""
    return {d.name: {int(p.name.split("_")[2]) for p in d.glob("*.distcp")} for d in (step / "optim").iterdir()
            if d.is_dir()}  # fmt: skip
