"""The weaker sandbox, used only when named (``SandboxLimits.jail = "process"``, a recipe's
``workflow.grader_jail: process``; never as a silent fallback): the child runs as a plain process in a new session, with rlimits, a network
namespace when it can make one, an unprivileged uid per slot when the trainer is root, and the audit
hook. This is the sandbox the jail replaced; it does not hold against a determined program (see
``areal_npu/agent/jail.py`` for what does), and ``SandboxResult.layers`` says it was used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class _Slots:
    """Small integers handed to concurrent runs in this process, so each gets its own uid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: set[int] = set()
        self._next = 0

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.add(slot)


SLOTS = _Slots()


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as fh:
                state = b""
                for line in fh:
                    if line.startswith(b"State:"):
                        state = line.split()[1]
                    elif line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid and state not in (b"Z", b"X"):
                            pids.append(int(entry))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _kill_everything(pgid: int, uid: int | None) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # a fork bomb races us; RLIMIT_NPROC keeps the race short
        pids = _uid_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def run_child(
    child_script: str,
    payload_path: Path,
    out,
    err,
    workdir: Path,
    result_fd: int,
    uid: int | None,
    wall_seconds: float,
) -> tuple[int | None, int | None, bool]:
    """``(exit_code, signal, timed_out)`` of the child run as a plain process."""
    if uid is not None:
        os.chown(workdir, uid, uid)
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": str(workdir), "HOME": str(workdir)}
    with open(payload_path, "rb") as stdin:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", child_script],
            stdin=stdin, stdout=out, stderr=err, cwd=workdir, env=env, close_fds=True,
            pass_fds=(result_fd,), start_new_session=True,
        )  # fmt: skip
    timed_out = False
    try:
        proc.wait(timeout=wall_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_everything(proc.pid, uid)
    proc.wait()
    code = proc.returncode
    return (None, -code, timed_out) if code < 0 else (code, None, timed_out)
