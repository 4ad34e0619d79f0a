"""An engine keeps its planned cores across a restart from a narrowed thread, and a local start
moves off a port taken before the engine binds it. Stand-in servers (no vLLM) that do what the real
server does with its start environment (apply ``AREAL_ENGINE_CPUS`` to themselves)."""

from __future__ import annotations

import os
import socket
import sys
import textwrap

import pytest

from areal_npu.launch import engine_process
from areal_npu.launch.engine_process import EngineProcess, EngineStartError
from areal_npu.placement import Cluster, TrainerLayout, plan
from areal_npu.placement.env import ENGINE_CPUS_ENV
from areal_npu.rollout.config import RolloutConfig

# like rollout/server.py's main(): bind to AREAL_ENGINE_CPUS when set, then serve /health on the port
STAND_IN = textwrap.dedent(
    """
    import http.server, os, sys
    cpus = os.environ.get("AREAL_ENGINE_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if sys.argv[1] == "fail":
        raise SystemExit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


class StandIn(EngineProcess):
    fail = False

    def command(self):
        return [sys.executable, "-c", STAND_IN, "fail" if self.fail else str(self.port)]


def _cfg(tmp_path, **kw) -> RolloutConfig:
    return RolloutConfig(model="m", device="cpu", startup_timeout_s=30, log_dir=str(tmp_path), **kw)


def _child_view(engine: EngineProcess) -> tuple[set[int], str | None]:
    """What the kernel says about the running engine: its CPU affinity and AREAL_ENGINE_CPUS."""
    pid = engine.proc.pid
    raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
    env = dict(item.split("=", 1) for item in raw if "=" in item)
    return os.sched_getaffinity(pid), env.get(ENGINE_CPUS_ENV)


def _restart_narrowed(engine: EngineProcess, narrowed: set[int]) -> None:
    """Restart from this thread with its affinity narrowed to ``narrowed``, as trainer rank 0's
    client thread is when an engine dies mid-run; the thread's affinity is restored afterwards."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, narrowed)
    try:
        engine.restart()
        assert os.sched_getaffinity(0) == narrowed  # the restart did not widen this thread
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow one away")
def test_restart_from_a_narrowed_thread_keeps_the_planned_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    machine = os.sched_getaffinity(0)
    cfg = _cfg(tmp_path, num_engines=1)
    # the reference: the placement plan's cores for the engine on this machine's cores
    planned = set(plan(TrainerLayout(), cfg, Cluster("cpu", 1, tuple(sorted(machine)))).engines[0].devices)
    rank0 = {min(machine)}  # the trainer's core: the plan never gives it to the engine
    assert not planned & rank0
    engine = StandIn(cfg).start()
    try:
        first = _child_view(engine)
        assert first == (planned, ",".join(map(str, sorted(planned))))
        _restart_narrowed(engine, rank0)
        assert engine.restarts == 1 and engine.healthy()
        assert _child_view(engine) == first
    finally:
        engine.stop(grace_s=2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow one away")
def test_restart_keeps_the_launch_affinity_when_nothing_is_pinned(tmp_path, monkeypatch):
    """The user's VLLM_CPU_OMP_THREADS_BIND wins (no slice is pinned): the engine runs on the
    affinity it was launched with, before and after a restart from a narrowed thread."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "all")
    machine = os.sched_getaffinity(0)
    engine = StandIn(_cfg(tmp_path)).start()
    try:
        assert _child_view(engine) == (machine, None)
        _restart_narrowed(engine, {min(machine)})
        assert _child_view(engine) == (machine, None)
    finally:
        engine.stop(grace_s=2)


def _first_free_port_is(monkeypatch, taken: int) -> list[int]:
    """``free_port`` returns ``taken`` once (the race: it was free when picked), then real ones."""
    picked = []
    real = engine_process.free_port

    def pick(host="127.0.0.1"):
        picked.append(taken if not picked else real(host))
        return picked[-1]

    monkeypatch.setattr(engine_process, "free_port", pick)
    return picked


def test_local_start_moves_off_a_port_taken_before_it_binds(tmp_path, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picked = _first_free_port_is(monkeypatch, taken)
        engine = StandIn(_cfg(tmp_path)).start()
        try:
            assert picked[0] == taken and engine.port == picked[-1] != taken
            assert engine.healthy() and engine.url.endswith(f":{engine.port}")
            assert "Address already in use" in engine.log_path.read_text()  # the first try's bind
        finally:
            engine.stop(grace_s=2)


def test_taken_port_retries_are_bounded_and_other_failures_not_retried(tmp_path, monkeypatch):
    starts = []
    original = EngineProcess._start_once
    monkeypatch.setattr(EngineProcess, "_start_once", lambda self: starts.append(self.port) or original(self))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(engine_process, "free_port", lambda host="127.0.0.1": taken)  # always the held one
        with pytest.raises(EngineStartError, match="exited with code 1"):
            StandIn(_cfg(tmp_path)).start()
        assert starts == [taken] * (1 + engine_process.PORT_RETRIES)
        starts.clear()
        with pytest.raises(EngineStartError, match="exited with code 1"):  # the recipe fixed the port
            StandIn(_cfg(tmp_path, base_port=taken)).start()
        assert starts == [taken]
    starts.clear()
    failing = StandIn(_cfg(tmp_path))
    failing.fail = True
    with pytest.raises(EngineStartError, match="exited with code 3"):
        failing.start()
    assert len(starts) == 1
