"""Limits for a whole jailed process tree: one control group per jailed command.

rlimits are per process (4 processes get 4x the CPU seconds and 4x the address space); a control
group counts the tree together. Two kernels' interfaces are handled:

- cgroup v2 when this process's own group is delegated (its ``cgroup.subtree_control`` already
  enables memory, pids and cpu, and a child group can be created);
- cgroup v1 when the memory, pids, cpu and cpuacct hierarchies are mounted and writable (a root
  container on a hybrid host, as on the development machines).

Otherwise :func:`open_group` returns ``None`` with the reason, and the jail falls back to per-process
rlimits plus the PID-namespace kill (nothing outlives a command either way).

What a group enforces: ``memory_bytes`` for the tree (the kernel OOM-kills inside it), at most
``max_processes`` tasks (fork fails with EAGAIN past it), a CPU *rate* of ``cpu_cores`` and a CPU
*budget* of ``cpu_seconds`` summed over the tree (the jail polls the usage and kills at the budget).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
_V2_CONTROLLERS = ("memory", "pids", "cpu")
_PERIOD_US = 100_000


@dataclass(frozen=True)
class TreeLimits:
    memory_bytes: int
    max_processes: int
    cpu_seconds: float
    cpu_cores: float = 1.0


def _own_paths() -> dict[str, str]:
    """``{controller: path}`` of this process's groups; v2's unified entry is keyed ``""``."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _v1_mounts() -> dict[str, Path]:
    """``{controller: mount point}`` of the mounted v1 hierarchies."""
    mounts = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup":
            for option in fields[3].split(","):
                if option in _V1_CONTROLLERS:
                    mounts[option] = Path(fields[1])
    return mounts


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


class Group:
    """One control group (v1: one per controller) holding one jailed command's process tree."""

    def __init__(self, kind: str, dirs: dict[str, Path], limits: TreeLimits):
        self.kind, self.dirs, self.limits = kind, dirs, limits

    @property
    def layer(self) -> str:
        return f"cgroup_{self.kind}"

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a launcher writes its own pid into before it execs the jail."""
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def _apply(self) -> None:
        lim = self.limits
        quota = max(1000, int(lim.cpu_cores * _PERIOD_US))
        if self.kind == "v2":
            d = self.dirs["unified"]
            _write(d / "memory.max", str(lim.memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(lim.max_processes))
            _write(d / "cpu.max", f"{quota} {_PERIOD_US}")
            return
        _write(self.dirs["memory"] / "memory.limit_in_bytes", str(lim.memory_bytes))
        memsw = self.dirs["memory"] / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # swap accounting: memory+swap gets the same cap, so no escape into swap
            _write(memsw, str(lim.memory_bytes))
        _write(self.dirs["pids"] / "pids.max", str(lim.max_processes))
        _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(_PERIOD_US))
        _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota))

    def cpu_seconds(self) -> float:
        try:
            if self.kind == "v2":
                for line in (self.dirs["unified"] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return 0.0
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return 0.0

    def _counter(self, controller: str, filename: str, key: str) -> int:
        try:
            for line in (self.dirs[controller] / filename).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def oom_killed(self) -> bool:
        if self.kind == "v2":
            return self._counter("unified", "memory.events", "oom_kill") > 0
        return self._counter("memory", "memory.oom_control", "oom_kill") > 0

    def hit_process_limit(self) -> bool:
        controller = "unified" if self.kind == "v2" else "pids"
        return self._counter(controller, "pids.events", "max") > 0

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def kill_and_remove(self, timeout: float = 10.0) -> None:
        """SIGKILL whatever is still inside (the PID-namespace kill normally got there first), then
        remove the groups; they can be removed only once empty."""
        deadline = time.monotonic() + timeout
        kill_file = self.dirs.get("unified", Path("/nonexistent")) / "cgroup.kill"
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                break
            if kill_file.exists():
                _write(kill_file, "1")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last task is being reaped
                    time.sleep(0.01)


def _make_dirs(parents: dict[str, Path]) -> dict[str, Path]:
    name = f"areal-jail-{secrets.token_hex(6)}"
    made: dict[str, Path] = {}
    try:
        for key, parent in parents.items():
            made[key] = parent / name
            made[key].mkdir()
    except OSError:
        for d in made.values():
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    return made


def _v2_parent() -> tuple[Path | None, str]:
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        return None, "cgroup v2 is not the mounted hierarchy (/sys/fs/cgroup/cgroup.controllers missing)"
    try:
        own = CGROUP_ROOT / _own_paths().get("", "/").lstrip("/")
        enabled = set((own / "cgroup.subtree_control").read_text().split())
    except OSError as exc:
        return None, f"cgroup v2: cannot read this process's group ({exc})"
    missing = [c for c in _V2_CONTROLLERS if c not in enabled]
    if missing:
        return None, f"cgroup v2 group {own} does not delegate {', '.join(missing)} to children"
    return own, ""


def _v1_parents() -> tuple[dict[str, Path] | None, str]:
    try:
        mounts, own = _v1_mounts(), _own_paths()
    except OSError as exc:
        return None, f"cgroup v1: cannot read the mounts ({exc})"
    missing = [c for c in _V1_CONTROLLERS if c not in mounts]
    if missing:
        return None, f"cgroup v1 hierarchies not mounted: {', '.join(missing)}"
    parents = {}
    for controller in _V1_CONTROLLERS:
        here = mounts[controller] / own.get(controller, "/").lstrip("/")
        parents[controller] = here if here.is_dir() else mounts[controller]
    return parents, ""


def open_group(limits: TreeLimits) -> tuple[Group | None, str]:
    """A fresh group with ``limits`` applied, or ``(None, why not)``."""
    reasons = []
    v2, why = _v2_parent()
    if v2 is not None:
        try:
            group = Group("v2", _make_dirs({"unified": v2}), limits)
            group._apply()
            return group, ""
        except OSError as exc:
            reasons.append(f"cgroup v2: {exc}")
    else:
        reasons.append(why)
    v1, why = _v1_parents()
    if v1 is None:
        reasons.append(why)
        return None, "; ".join(reasons)
    try:
        group = Group("v1", _make_dirs(v1), limits)
    except OSError as exc:
        return None, "; ".join(reasons + [f"cgroup v1: cannot create a group ({exc})"])
    try:
        group._apply()
    except OSError as exc:
        group.kill_and_remove()
        return None, "; ".join(reasons + [f"cgroup v1: cannot set limits ({exc})"])
    return group, ""


def probe() -> tuple[bool, str]:
    """Whether a group can be made here now (one is made and removed), and why not."""
    group, why = open_group(TreeLimits(64 << 20, 8, 1.0))
    if group is None:
        return False, why
    group.kill_and_remove()
    return True, ""
