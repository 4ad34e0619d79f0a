"""What runs inside the Ray launcher's actors: each actor holds one planned process in its bundle.

* :class:`ProcessRunner` -- a trainer rank: ``python -m areal_npu.cli train RECIPE ...`` with the
  plan's environment (torchrun's variables), in a session of its own behind a small wrapper
  (``launch.ray_child``) that ends the session when the actor dies, so a killed actor leaves no trainer.
* :class:`EngineRunner` -- a rollout engine: the same :class:`~areal_npu.launch.engine_process.EngineProcess`
  the local launcher starts (a real vLLM server process group that dies with its parent), with the
  plan's engine environment.

Ray, not the plan, picks the physical NPUs / GPUs of an actor (it sets the visible-devices variable
from the bundle's resources), so on accelerators the plan's ids are replaced by Ray's; on the CPU
Ray names no cores and the plan's core sets apply. Each actor writes a report
(``<report_dir>/<process>.json``: pid, Ray node, placement group and bundle, the process's
environment as the kernel has it, its CPU affinity) -- what the launcher's test checks against the
plan.

These are plain classes: the launcher wraps them with ``ray.remote`` when it places them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from areal_npu import platform as plat

LOG_TAIL_LINES = 40


def report_path(report_dir: str | Path, process: str) -> Path:
    return Path(report_dir) / (process.replace("/", "-") + ".json")


def placed_env(kind: str, planned: dict[str, str]) -> dict[str, str]:
    """The planned environment with Ray's devices for this actor on accelerators (Ray chose them
    from the bundle; a plan's physical ids mean nothing on the node Ray picked)."""
    env = dict(planned)
    variable = plat.PROFILES[kind].visible_devices_env
    if variable is not None:
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids().get(plat.PROFILES[kind].ray_resource, [])
        env[variable] = ",".join(str(i) for i in ids)
    return env


def _proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _where() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(),
            "bundle": _bundle_index(), "resources": ctx.get_assigned_resources()}  # fmt: skip


def _bundle_index() -> int | None:
    """The bundle this actor consumes, as Ray accounts it: resources named
    ``bundle_group_<index>_<group id>`` (Ray's public runtime context names the group, not the
    bundle). None where this Ray version keeps no such record."""
    import ray

    try:
        names = ray._private.worker.global_worker.core_worker.resource_ids()
    except Exception:  # noqa: BLE001 - a private API: the report says "unknown" rather than fail
        return None
    for name in names:
        parts = name.split("_")
        if name.startswith("bundle_group_") and len(parts) == 4 and parts[2].isdigit():
            return int(parts[2])
    return None


def write_report(report_dir, process: str, pid: int, planned: dict[str, str], **extra) -> dict:
    """What the kernel says about ``pid``: its environment (the planned keys) and CPU affinity."""
    seen = _proc_environ(pid)
    report = {"process": process, "pid": pid, **_where(),
              "env": {k: seen.get(k) for k in planned}, "affinity": sorted(os.sched_getaffinity(pid)), **extra}  # fmt: skip
    path = report_path(report_dir, process)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    return report


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ProcessRunner:
    """One trainer rank as a child process group of this actor."""

    def __init__(self, process: str, command: list[str], env: dict[str, str], kind: str, log_path: str,
                 report_dir: str, cwd: str | None = None):  # fmt: skip
        self.process, self.command, self.kind, self.cwd = process, command, kind, cwd
        self.env = placed_env(kind, env)
        self.log_path, self.report_dir = Path(log_path), report_dir
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict:
        cores = None
        if self.kind == "cpu" and self.env.get(plat.CPU_AFFINITY_ENV):
            cores = plat.parse_id_list(self.env[plat.CPU_AFFINITY_ENV])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_npu.launch.ray_child", *self.command],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, cwd=self.cwd,
                start_new_session=True, preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
            )  # fmt: skip
        return write_report(self.report_dir, self.process, self.proc.pid, self.env)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return tail(self.log_path, lines)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM to the whole group (the rank reacts as to Ctrl-C), SIGKILL after ``grace_s``."""
        if self.proc is None:
            return None
        _kill_group(self.proc, grace_s)
        return self.proc.returncode


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class EngineRunner:
    """One rollout engine (an :class:`EngineProcess`) in this actor's bundle."""

    def __init__(self, process: str, cfg_json: str, index: int, env: dict[str, str], kind: str,
                 secret: str, report_dir: str, host: str | None = None):  # fmt: skip
        from areal_npu.launch.engine_process import EngineProcess
        from areal_npu.rollout.config import RolloutConfig

        self.process, self.report_dir = process, report_dir
        self.env = placed_env(kind, env)
        os.environ.update(self.env)  # EngineProcess starts from this process's environment
        if host is None:  # several nodes: listen on this Ray node's address
            import ray

            host = ray.util.get_node_ip_address()
        cfg = RolloutConfig.from_dict(json.loads(cfg_json))
        self.engine = EngineProcess(cfg, index=index, host=host, secret=secret)

    def start(self) -> dict:
        """Blocks until the engine is healthy (``EngineStartError`` with its log tail otherwise).

        A port picked free can be taken before vLLM binds it: on a node running Ray, whose
        processes open many outgoing connections, that happened in one of our first runs
        (EADDRINUSE). ``EngineProcess.start`` then retries on a new free port, a bounded number
        of times (``engine_process.PORT_RETRIES``), as it does for the local launcher."""
        self.engine.start()
        return self._report()

    def _report(self, **extra) -> dict:
        pid = self.engine.proc.pid if self.engine.proc else -1
        return write_report(self.report_dir, self.process, pid, self.env, url=self.engine.url,
                            log=str(self.engine.log_path), restarts=self.engine.restarts, **extra)  # fmt: skip

    def url(self) -> str:
        return self.engine.url

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.engine.healthy(timeout_s)

    def alive(self) -> bool:
        return self.engine.alive()

    def restart(self) -> str:
        self.engine.restart()
        self._report()
        return self.engine.url

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return tail(self.engine.log_path, lines)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stops the engine; first records the weight version it serves (``final_version``)."""
        version = None
        if self.engine.healthy():
            import httpx

            from areal_npu.rollout import guard

            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = httpx.get(self.engine.url + "/areal/version", timeout=5.0,
                                     headers=guard.auth_headers(self.engine.secret))  # fmt: skip
                version = response.json().get("version")
            self._report(final_version=version, stopped_at=time.time())
        self.engine.stop(grace_s)
