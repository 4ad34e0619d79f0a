"""Execution sandbox for untrusted programs: one short-lived child process per program, every test in it.

Layers, outermost first (``SandboxResult.layers`` says which were active for a run):

- ``clean_env``: ``python -I -S -B`` (no PYTHON* variables, no site, no user site), an environment of
  just ``PATH``/``LC_ALL``, ``close_fds`` (only stdin/stdout/stderr and the result fd are inherited).
- ``workdir``: a fresh temporary directory as cwd (``TMPDIR`` too), removed afterwards.
- ``new_session``: the child leads its own session/process group; the group is SIGKILLed after every
  run, so grandchildren die with it.
- ``netns``: ``unshare(CLONE_NEWNET)`` (root/CAP_SYS_ADMIN; else an unprivileged user namespace):
  the only interface is a down loopback, so nothing is reachable.
- ``rlimits``: RLIMIT_CPU (SIGXCPU → "timeout"), RLIMIT_AS ("memory"), RLIMIT_FSIZE (stdout/stderr
  are files, so it caps output too; SIGXFSZ → "output_limit"), RLIMIT_NOFILE, RLIMIT_NPROC, no cores.
- ``uid``: when the parent is root, the child drops to a uid of its own (``uid_base + slot``) after
  its imports. RLIMIT_NPROC does not apply to root; for that uid it does, which stops fork bombs,
  and the parent SIGKILLs every process of that uid afterwards (which catches ``setsid`` escapes).
  The uid cannot read ``/root``, other users' ``/proc/<pid>/environ`` or write root-owned files.
- ``audit_hook``: ``sys.addaudithook`` kills the child (exit 86 → "blocked_syscall") on sockets,
  ctypes, subprocess/exec/fork/kill, frame and gc introspection, writes outside the workdir,
  ``/proc``/``/sys`` access and imports of dangerous modules. In-process hooks are a tripwire, not a
  wall; the kernel layers above are what hold.
- parent side: a wall-clock timeout ("timeout"), and a byte cap on everything read back.

Result protocol, and why a program cannot forge its score. The parent writes the payload (program,
test INPUTS, a fresh random nonce) to the child's stdin; the child reads it and closes stdin before
running the program. The child writes exactly one frame, ``<nonce> <json>`` with one entry per input
(``{"ok": plain JSON value}`` or ``{"err": name}``), to a separate inherited file, not stdout. Then:

1. Expected outputs never leave the parent, and the score is computed in the parent by comparing the
   decoded plain JSON (exact types: ``True`` is not ``1``). Whatever the program does in its own
   process, the most it can do is choose the outputs it reports — which is what an honest answer
   does; it cannot report "passed".
2. Printing a fake frame to stdout does nothing: stdout is not read for results. A frame in the result
   file counts only if the file is exactly one line starting with the nonce and holding exactly one
   entry per input; anything else is "protocol_error" (reward 0). The nonce is reachable only by
   in-process introspection, which the audit hook blocks (frames, gc, ``__main__``); even a
   program that got it could only claim outputs, per point 1.
3. The program gets a copy of the builtins, so rebinding ``len`` or ``json`` internals of its own
   cannot change how the harness serialises; outputs are converted to exact builtin types before
   ``json.dumps`` so the parent never calls a method the program defined.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_npu.config import ConfigError

CHILD_SCRIPT = str(Path(__file__).with_name("_sandbox_child.py"))
BLOCKED_EXIT = 86  # keep in step with _sandbox_child.BLOCKED_EXIT
REASONS = (
    "ok", "wrong_answer", "crash", "syntax_error", "no_program", "timeout", "memory", "output_limit",
    "blocked_syscall", "protocol_error", "sandbox_error",
)  # fmt: skip


@dataclass
class SandboxLimits:
    """Per-program limits. All tests of one program share them (one child process)."""

    cpu_seconds: int = 2
    wall_seconds: float = 10.0
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10
    max_processes: int = 8
    max_open_files: int = 64
    audit_hook: bool = True
    drop_privileges: bool = True  # only when running as root
    uid_base: int = 1_560_000  # sandbox uids are uid_base + slot; nothing else should use them
    stderr_tail_bytes: int = 2048

    def validate(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "output_bytes", "max_processes", "max_open_files"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(name, f"must be >= 1; got {getattr(self, name)!r}")
        if self.memory_bytes < 64 << 20:
            raise ConfigError(
                "memory_bytes", f"must be >= 64 MiB (the interpreter needs it); got {self.memory_bytes}"
            )
        if not self.wall_seconds > 0:
            raise ConfigError("wall_seconds", f"must be > 0; got {self.wall_seconds!r}")
        if self.uid_base < 1000:
            raise ConfigError("uid_base", f"must be >= 1000 (not a system uid); got {self.uid_base}")


@dataclass
class SandboxResult:
    passed: int
    total: int
    reason: str  # one of REASONS
    stderr_tail: str = ""
    layers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class _Slots:
    """Small integers handed to concurrent runs, so each gets a uid no other live run uses."""

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


_SLOTS = _Slots()


def same_value(got: Any, expected: Any) -> bool:
    """Exact structural equality on plain JSON data: types must match (``True`` != ``1``, ``1.0`` != ``1``)."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(got) == len(expected) and all(same_value(g, e) for g, e in zip(got, expected))
    return got == expected


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``."""
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


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n))
            return fh.read(n).decode("utf-8", "replace")
    except OSError:
        return ""


def _parse_frame(raw: bytes, nonce: str, n_inputs: int) -> dict | None:
    prefix = nonce.encode() + b" "
    if not raw.startswith(prefix) or not raw.endswith(b"\n") or raw.count(b"\n") != 1:
        return None
    try:
        frame = json.loads(raw[len(prefix) :])
    except ValueError:
        return None
    if not isinstance(frame, dict) or not isinstance(frame.get("results"), list):
        return None
    results = frame["results"]
    reason = frame.get("reason", "")
    if reason not in ("", "syntax_error", "crash", "memory"):
        return None
    if not reason and len(results) != n_inputs:
        return None
    if not all(isinstance(r, dict) and len(r) == 1 and ("ok" in r or "err" in r) for r in results):
        return None
    return frame


def run_tests(
    program: str, tests: Sequence[tuple[Any, Any]], limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run ``program`` (Python source defining ``f``) on every ``(input, expected)`` in one sandboxed
    child; ``passed`` counts exact matches of ``f(input)`` against ``expected``. Never raises for
    anything the program does; infrastructure failures give reason "sandbox_error"."""
    limits = limits or SandboxLimits()
    limits.validate()
    total = len(tests)
    if not program.strip():
        return SandboxResult(0, total, "no_program")
    slot = _SLOTS.acquire()
    privileged = limits.drop_privileges and os.geteuid() == 0
    uid = limits.uid_base + slot if privileged else None
    private = Path(tempfile.mkdtemp(prefix="areal-sbx-io-"))  # 0700, parent's own: payload and captures
    workdir = Path(tempfile.mkdtemp(prefix="areal-sbx-wd-"))
    nonce = secrets.token_hex(16)
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        result_path, out_path, err_path = private / "result", private / "stdout", private / "stderr"
        result_fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        payload = {
            "program": program,
            "inputs": [inp for inp, _ in tests],
            "nonce": nonce,
            "result_fd": result_fd,
            "uid": uid,
            "gid": uid,
            "audit": limits.audit_hook,
            "limits": {
                "cpu_seconds": int(limits.cpu_seconds),
                "memory_bytes": int(limits.memory_bytes),
                "output_bytes": int(limits.output_bytes),
                "max_processes": int(limits.max_processes),
                "max_open_files": int(limits.max_open_files),
            },
        }
        (private / "payload").write_text(json.dumps(payload))
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": str(workdir), "HOME": str(workdir)}
        try:
            with (
                open(private / "payload", "rb") as stdin,
                open(out_path, "wb") as out,
                open(err_path, "wb") as err,
            ):
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", CHILD_SCRIPT],
                    stdin=stdin,
                    stdout=out,
                    stderr=err,
                    cwd=workdir,
                    env=env,
                    close_fds=True,
                    pass_fds=(result_fd,),
                    start_new_session=True,
                )
        finally:
            os.close(result_fd)
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_everything(proc.pid, uid)
        proc.wait()
        return _judge(proc.returncode, timed_out, result_path, out_path, err_path, nonce, tests, limits)
    except OSError as exc:
        return SandboxResult(0, total, "sandbox_error", stderr_tail=f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
        _SLOTS.release(slot)


def _judge(returncode, timed_out, result_path, out_path, err_path, nonce, tests, limits) -> SandboxResult:
    total = len(tests)
    stderr_tail = _tail(err_path, limits.stderr_tail_bytes)

    def fail(reason: str, layers=()) -> SandboxResult:
        return SandboxResult(0, total, reason, stderr_tail, tuple(layers))

    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return fail("timeout")
    if returncode == -signal.SIGXFSZ:
        return fail("output_limit")
    if returncode == BLOCKED_EXIT:
        return fail("blocked_syscall")
    big_output = any(p.stat().st_size >= limits.output_bytes for p in (out_path, err_path))
    if big_output:
        return fail("output_limit")
    if "MemoryError" in stderr_tail:
        return fail("memory")
    size = result_path.stat().st_size
    raw = b"" if size > 4 * limits.output_bytes * max(1, total) else result_path.read_bytes()
    frame = _parse_frame(raw, nonce, total) if returncode == 0 else None
    if frame is None:
        return fail("crash" if returncode != 0 and not raw else "protocol_error")
    layers = tuple(str(x) for x in frame.get("layers", ()))[:16]
    if frame["reason"]:
        return fail(frame["reason"], layers)
    passed, errors = 0, []
    for entry, (_, expected) in zip(frame["results"], tests):
        if "ok" in entry and same_value(entry["ok"], expected):
            passed += 1
        elif "err" in entry:
            errors.append(str(entry["err"]))
    if passed == total:
        reason = "ok"
    elif "MemoryError" in errors:
        reason = "memory"
    elif "OutputTooLong" in errors:
        reason = "output_limit"
    elif errors and not passed and len(errors) == total:
        reason = "crash"
    else:
        reason = "wrong_answer"
    return SandboxResult(passed, total, reason, stderr_tail, layers)


def grade_many(
    items: Sequence[tuple[str, Sequence[tuple[Any, Any]]]],
    max_workers: int = 4,
    limits: SandboxLimits | None = None,
) -> list[SandboxResult]:
    """``run_tests`` for many ``(program, tests)`` at once, at most ``max_workers`` children alive;
    results in input order. Threads only wait on children, so the GIL is not the bottleneck."""
    if max_workers < 1:
        raise ConfigError("max_workers", f"must be >= 1; got {max_workers}")
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda item: run_tests(item[0], item[1], limits), items))
