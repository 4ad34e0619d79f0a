"""Which CPU cores an engine started without a plan runs on, and starting a child on given cores.

The plan (``placement.plan``) gives each CPU engine its core set; a launch on one node that makes no
plan (``launch_engines``) computes the same kind of slice here, and writes the same environment
variables (:mod:`areal_npu.placement.env`) for the engine server to apply.
"""

from __future__ import annotations

import contextlib
import os

from areal_npu.placement.env import ENGINE_CPUS_ENV, OMP_BIND_ENV
from areal_npu.rollout.config import RolloutConfig


@contextlib.contextmanager
def thread_affinity(cores: set[int]):
    """This thread's CPU affinity set to ``cores`` for the block (a child started in it inherits
    them), restored afterwards; other threads are not affected."""
    before = os.sched_getaffinity(0)
    if before == cores:
        yield
        return
    try:
        os.sched_setaffinity(0, cores)
    except OSError:  # the cores are no longer allowed (the cpuset shrank): start where this thread runs
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cpu_binding(cfg: RolloutConfig, index: int, cores: set[int] | None = None) -> dict[str, str]:
    """On the CPU backend, the cores of engine ``index``: its whole process group runs there.

    Engines take the last cores of this process's affinity, ``n // (num_engines + 1)`` each (at
    least one), leaving the first ones to the trainer, which computes at the same time in
    asynchronous RL. Both vLLM's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``) and the engine's
    other processes (server, engine core; ``AREAL_ENGINE_CPUS``, applied by the server at start)
    are bound to that slice. Why the whole group: vLLM hands every step from the engine-core
    process to the worker and back; on the 2-vCPU VMs we measured, with those processes on
    different cores a tiny model decoded 4-6x slower and bimodally (cross-core wake-ups), with
    all of them on one core it was fast and steady (docs/BENCHMARKS.md). A user's
    ``VLLM_CPU_OMP_THREADS_BIND`` wins: then nothing is pinned. ``cores``: the affinity to split
    (default: this thread's).
    """
    if cfg.device_type() != "cpu" or cfg.tensor_parallel_size != 1:
        return {}
    if OMP_BIND_ENV in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    per_engine = max(1, len(cores) // (cfg.num_engines + 1))
    end = len(cores) - (index % max(1, len(cores) // per_engine)) * per_engine
    picked = ",".join(str(c) for c in cores[end - per_engine : end])
    return {OMP_BIND_ENV: picked, ENGINE_CPUS_ENV: picked}
