"""The cores a CPU engine's process group gets when the launcher starts it without a plan
(``launch/cpu_binding.py``): disjoint slices that leave the first cores to the trainer, the user's
binding left alone, and the same cores the placement plan gives the engines."""

import os

import pytest

from areal_npu.launch.cpu_binding import cpu_binding
from areal_npu.placement import Cluster, TrainerLayout, plan
from areal_npu.placement.env import ENGINE_CPUS_ENV
from areal_npu.rollout.config import RolloutConfig


@pytest.mark.parametrize(("engines", "cores"), [(1, 2), (2, 2), (1, 16), (2, 16), (3, 4), (4, 4)])
def test_engines_get_disjoint_core_slices_whole_group(monkeypatch, engines, cores):
    """Each engine gets its own cores (disjoint while there are enough), for vLLM's OpenMP threads
    and its other processes alike; with spare cores, the first ones stay with the trainer."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    cfg = RolloutConfig(model="m", device="cpu", num_engines=engines)
    slices = []
    for i in range(engines):
        env = cpu_binding(cfg, i)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == env[ENGINE_CPUS_ENV]
        slices.append({int(c) for c in env[ENGINE_CPUS_ENV].split(",")})
    assert all(s and s <= set(range(cores)) for s in slices)
    assert len({c for s in slices for c in s}) == sum(len(s) for s in slices)  # disjoint
    if cores > engines:
        assert 0 not in {c for s in slices for c in s}  # the trainer keeps core 0


def test_user_binding_and_non_cpu_devices_are_left_alone(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert cpu_binding(RolloutConfig(model="m", device="cpu", num_engines=2), 1) == {}  # the user's setting wins
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert cpu_binding(RolloutConfig(model="m", device="npu", num_engines=2), 0) == {}


@pytest.mark.parametrize(("engines", "cores"), [(1, 2), (1, 16), (2, 16), (3, 4), (1, 5)])
def test_cpu_engines_get_the_cores_the_launcher_gives_them_today(monkeypatch, engines, cores):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    cfg = RolloutConfig(model="m", device="cpu", num_engines=engines)
    today = {int(c) for i in range(engines) for c in cpu_binding(cfg, i)[ENGINE_CPUS_ENV].split(",")}
    result = plan(TrainerLayout(), cfg, Cluster.uniform("cpu", 1, cores))
    assert {c for p in result.engines for c in p.devices} == today
