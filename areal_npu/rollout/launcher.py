"""Start, health-check, restart and stop rollout engine processes (one process group each).

Each engine runs ``python -m areal_npu.rollout.server`` in a new session (``start_new_session``),
so the server, vLLM's engine-core process and its workers form one process group that we kill as
a whole: on ``stop()``, at interpreter exit (``atexit``), and on SIGTERM / SIGINT (Ctrl-C) -- no
orphans. Start-up waits for ``/health`` with a timeout; a failed or slow start raises
:class:`EngineStartError` carrying the tail of the engine's log.

Each run has one secret (``guard.make_secret``), which every engine of the run gets in its
environment -- not on its command line, which any user can read in ``/proc`` -- and every request
to it must carry (``guard.py``); it is kept on the :class:`EngineProcess` objects, in memory only.
An engine listens on the address it is given (the plan's host for it; ``rollout.host``, 127.0.0.1
by default), never on every interface.

An engine's CPU binding (its affinity and core slice) is fixed at its first start and reused by
every restart; a start whose free port was taken before the engine bound it retries on a new one
(:meth:`EngineProcess.start`; the Ray launcher's engine actors start engines the same way).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from areal_npu.rollout import guard
from areal_npu.rollout.config import RolloutConfig

LOG_TAIL_LINES = 40
#: New free ports a start may try after the one it picked was taken before the engine bound it.
PORT_RETRIES = 2
_LIVE: weakref.WeakSet[EngineProcess] = weakref.WeakSet()
_INSTALLED = {"atexit": False, "signals": False}


class EngineStartError(RuntimeError):
    """The engine did not become healthy; the message ends with the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


ENGINE_CPUS_ENV = "AREAL_ENGINE_CPUS"


def port_taken(log_text: str) -> bool:
    """Whether a failed start's log says its port was taken (EADDRINUSE, as Python, uvicorn and
    vLLM word it)."""
    return "Address already in use" in log_text or "EADDRINUSE" in log_text


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
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    per_engine = max(1, len(cores) // (cfg.num_engines + 1))
    end = len(cores) - (index % max(1, len(cores) // per_engine)) * per_engine
    picked = ",".join(str(c) for c in cores[end - per_engine : end])
    return {"VLLM_CPU_OMP_THREADS_BIND": picked, ENGINE_CPUS_ENV: picked}


def _kill_all_live(*_args) -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(Exception):
            proc.stop(grace_s=2.0)


def _install_handlers() -> None:
    """atexit + SIGTERM/SIGINT: kill every engine group, then let the previous handler run.

    Signal handlers can only be set from the main thread; a start from another thread installs
    them at the next start from the main thread (atexit covers the rest). A signal this process
    ignores stays ignored: a shell starts background jobs (``cmd &``, nohup) with SIGINT ignored,
    and killing the engines on it would only make the loop restart them and go on.
    """
    if not _INSTALLED["atexit"]:
        atexit.register(_kill_all_live)
        _INSTALLED["atexit"] = True
    if _INSTALLED["signals"] or threading.current_thread() is not threading.main_thread():
        return
    _INSTALLED["signals"] = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:
            continue

        def handler(sig, frame, previous=previous):
            _kill_all_live()
            if callable(previous):
                previous(sig, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)


class EngineProcess:
    """One engine: ``start()`` (blocks until healthy), ``alive()``, ``restart()``, ``stop()``."""

    def __init__(
        self,
        cfg: RolloutConfig,
        index: int = 0,
        port: int | None = None,
        *,
        host: str | None = None,
        secret: str | None = None,
    ):
        if host is not None and host != cfg.host:  # the plan's address for this engine
            import dataclasses

            cfg = dataclasses.replace(cfg, host=host)
        self.cfg = cfg
        self.index = index
        self.secret = secret or guard.make_secret()  # the run's, when launch_engines starts it
        self.port = port or (cfg.base_port + index if cfg.base_port else 0)
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.restarts = 0
        #: the affinity and environment of the first start, reused by every restart (see start())
        self.launch_cores: set[int] | None = None
        self.launch_env: dict[str, str] | None = None
        log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="areal-rollout-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"engine{index}.log"
        self._lock = threading.RLock()  # re-entrant: a signal handler may stop() mid-stop()

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "areal_npu.rollout.server",
            "--config",
            self.cfg.to_json(),
            "--port",
            str(self.port),
        ]

    def start(self) -> EngineProcess:
        """Start and wait until healthy.

        The CPU binding is fixed at the first start: the cores and environment the engine got then
        (:func:`cpu_binding` of the launching thread's affinity) are stored and every restart
        reuses them. A restart comes later, from the client's thread in a process that may have
        narrowed its own affinity since (trainer rank 0 pins itself to its cores, ``run.py``); a
        binding recomputed there would put the engine on rank 0's cores.

        A port picked free can be taken before the engine binds it, a minute of imports later
        (EADDRINUSE in its log): then it starts again on a new free port, up to
        :data:`PORT_RETRIES` times. A port the recipe fixed (``rollout.base_port``) is not changed.
        """
        _install_handlers()
        if self.launch_cores is None:
            self.launch_cores = os.sched_getaffinity(0)
            self.launch_env = {
                **self.cfg.engine_env(),
                **cpu_binding(self.cfg, self.index, self.launch_cores),
            }
        for attempt in range(PORT_RETRIES + 1):
            if not self.port or (self.restarts and not self.cfg.base_port and attempt == 0):
                self.port = free_port(self.cfg.host)
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            try:
                return self._start_once()
            except EngineStartError:
                if (
                    self.cfg.base_port
                    or attempt == PORT_RETRIES
                    or not port_taken(self._log_since(log_start))
                ):
                    raise
                self.port = 0  # the next attempt picks a new free port
        raise AssertionError("unreachable")

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _start_once(self) -> EngineProcess:
        env = {**os.environ, **self.launch_env, guard.SECRET_ENV: self.secret}
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        log.write(f"\n==== start {time.strftime('%H:%M:%S')} port {self.port} ====\n".encode())
        log.flush()
        with thread_affinity(self.launch_cores):  # the child inherits the cores of the first start
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        log.close()
        self.pgid = self.proc.pid  # session leader: its pid is the process group id
        _LIVE.add(self)
        try:
            self.wait_healthy(self.cfg.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll() if self.proc else -1
            if code is not None:
                raise EngineStartError(
                    f"engine {self.index} exited with code {code} during start-up; log {self.log_path}:\n"
                    + log_tail(self.log_path)
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine {self.index} not healthy after {timeout_s:.0f} s; log {self.log_path}:\n"
                    + log_tail(self.log_path)
                )
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        import httpx

        if not self.alive():
            return False
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def group_alive(self) -> bool:
        """Whether any process of this engine's group still exists (orphan check)."""
        if self.pgid is None:
            return False
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL after ``grace_s``; reaps the leader."""
        with self._lock:
            if self.pgid is None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.group_alive() and time.monotonic() < deadline:
                if self.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=0.1)
                else:
                    time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=5)
            # children reparented to init are reaped by it; wait until the group is gone
            deadline = time.monotonic() + 5
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.pgid = None
            _LIVE.discard(self)

    def restart(self) -> None:
        self.stop(grace_s=2.0)
        self.restarts += 1
        self.start()

    def info(self) -> dict:
        return {"index": self.index, "url": self.url, "pid": self.pgid, "log": str(self.log_path)}


def launch_engines(cfg: RolloutConfig, hosts: list[str] | None = None) -> list[EngineProcess]:
    """Validate, then start ``cfg.num_engines`` engines concurrently, with one new secret for the
    run; returns once all are healthy (any failure stops them all and raises). ``hosts``: the
    address each engine listens on (the plan's), else ``cfg.host``."""
    cfg.validate()
    if not cfg.model:
        raise ValueError("model must name a checkpoint directory")
    if hosts is not None and len(hosts) != cfg.num_engines:
        raise ValueError(f"{len(hosts)} hosts for {cfg.num_engines} engines")
    placed = ray_placed_engines(cfg)
    if placed is not None:
        return placed
    from concurrent.futures import ThreadPoolExecutor

    _install_handlers()  # from the main thread, before the start-up threads
    secret = guard.make_secret()
    engines = [
        EngineProcess(cfg, index=i, host=hosts[i] if hosts else None, secret=secret)
        for i in range(cfg.num_engines)
    ]
    try:
        # all at once: start-up is mostly imports and model loading, each in its own processes
        with ThreadPoolExecutor(max_workers=cfg.num_engines) as pool:
            for future in [pool.submit(engine.start) for engine in engines]:
                future.result()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


#: Set by the Ray launcher (``placement/ray_launch.py``) for trainer rank 0 only: JSON naming the
#: placement-group bundles its engines go into (``placement/ray_engines.py``).
RAY_ENGINES_ENV = "AREAL_RAY_ENGINES"


def ray_placed_engines(cfg: RolloutConfig) -> list | None:
    """Under the Ray launcher, the engines started as Ray actors in the bundles it reserved
    (objects with ``EngineProcess``'s interface); None when this process was not started by it."""
    spec = os.environ.get(RAY_ENGINES_ENV)
    if not spec:
        return None
    from areal_npu.placement.ray_engines import launch_ray_engines

    return launch_ray_engines(cfg, json.loads(spec))


def describe(engines: list[EngineProcess]) -> str:
    return json.dumps([e.info() for e in engines])
