"""Start, health-check, restart and stop one rollout engine process (one process group each).

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

This module starts one engine; :mod:`areal_npu.launch.engines` starts a run's engines (here or
under Ray) and :mod:`areal_npu.launch.cpu_binding` picks an engine's cores.
"""

from __future__ import annotations

import atexit
import contextlib
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

from areal_npu.launch.cpu_binding import cpu_binding, thread_affinity
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


def port_taken(log_text: str) -> bool:
    """Whether a failed start's log says its port was taken (EADDRINUSE, as Python, uvicorn and
    vLLM word it)."""
    return "Address already in use" in log_text or "EADDRINUSE" in log_text


def _kill_all_live(*_args) -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(Exception):
            proc.stop(grace_s=2.0)


def install_stop_handlers() -> None:
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
        install_stop_handlers()
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
