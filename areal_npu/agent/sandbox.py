"""Execution sandbox for untrusted programs: one jailed child process per program, every test in it.

The wall is the jail (:mod:`areal_npu.agent.jail`: bubblewrap namespaces, seccomp, no capabilities,
a control group for the process tree, nothing of the host but ``/usr`` and the interpreter). Inside
it ``_sandbox_child.py`` (mounted read-only, run by ``python -I -S -B``) adds per-process rlimits
and, by default, an audit hook — a tripwire that names what a program tried ("blocked_syscall"),
not a wall. ``SandboxResult.layers`` says what held for a run. Where no jail can start (no user
namespaces) ``jail="auto"`` / ``"bwrap"`` refuse ("sandbox_error", and the workflows refuse the recipe
at ``--check``); the old process sandbox (``_process_sandbox.py``) runs only when named
(``jail="process"``: a recipe's ``workflow.grader_jail: process``).

Result protocol, and why a program cannot forge its score. The parent writes the payload (program,
test INPUTS, a fresh random nonce) to the child's stdin; the child reads it and closes stdin before
running the program. The child writes exactly one frame, ``<nonce> <json>`` with one entry per
input, to a separate inherited file, not stdout. Then:

1. Expected outputs never leave the parent, and the score is computed in the parent by comparing the
   decoded values (exact types: ``True`` is not ``1``). The most a program can do is choose the
   outputs it reports — which is what an honest answer does; it cannot report "passed".
2. The frame is untrusted input (:mod:`areal_npu.agent.sandbox_protocol`): anything but exactly one
   well-formed line with the nonce and one entry per input is "protocol_error" (reward 0), and
   nothing a program writes can raise in the trainer.
3. Stderr is read only when there is no frame (a crash), so printing "MemoryError" or a fake
   frame changes nothing for a correct program.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_npu.agent import _process_sandbox
from areal_npu.agent.jail import JailLimits, Mount, backend, interpreter
from areal_npu.agent.sandbox_protocol import parse_frame, same_value, score
from areal_npu.config import ConfigError

__all__ = ["REASONS", "SandboxLimits", "SandboxResult", "grade_many", "run_tests", "same_value"]

CHILD_SCRIPT = str(Path(__file__).with_name("_sandbox_child.py"))
CHILD_IN_JAIL = "/grader/child.py"
BLOCKED_EXIT = 86  # keep in step with _sandbox_child.BLOCKED_EXIT
JAILS = ("auto", "bwrap", "process")
REASONS = (
    "ok", "wrong_answer", "crash", "syntax_error", "no_program", "timeout", "memory", "output_limit",
    "blocked_syscall", "protocol_error", "sandbox_error",
)  # fmt: skip


@dataclass
class SandboxLimits:
    """Per-program limits. All tests of one program share them (one child process). In the jail,
    ``cpu_seconds``, ``memory_bytes`` and ``max_processes`` hold for the program's whole process
    tree (when a control group can be made; per process otherwise)."""

    cpu_seconds: int = 2
    wall_seconds: float = 10.0
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10
    max_processes: int = 8
    max_open_files: int = 64
    audit_hook: bool = True
    jail: str = "auto"  # "bwrap" = "auto" (refused where it cannot start) | "process" (the weaker sandbox, by name)
    drop_privileges: bool = True  # "process" jail only, when running as root
    uid_base: int = 1_560_000  # "process" jail only: its uids are uid_base + slot
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
        if self.jail not in JAILS:
            raise ConfigError("jail", f"must be one of {', '.join(JAILS)}; got {self.jail!r}")


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


def resolve_jail(name: str) -> tuple[str, str]:
    """``(jail used, why not the one asked for)``: "auto" and "bwrap" are the jail or "unavailable" (with
    the reason); the weaker process sandbox only when it is named -- never as a silent fallback."""
    if name == "process":
        return "process", ""
    ok, why = backend("bwrap").available()
    return ("bwrap", "") if ok else ("unavailable", why)


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read(n).decode("utf-8", "replace")
    except OSError:
        return ""


def run_tests(
    program: str,
    tests: Sequence[tuple[Any, Any]],
    limits: SandboxLimits | None = None,
    mounts: Sequence[Mount] = (),
    sys_path: Sequence[str] = (),
) -> SandboxResult:
    """Run ``program`` (Python source defining ``f``) on every ``(input, expected)`` in one sandboxed
    child; ``passed`` counts exact matches of ``f(input)`` against ``expected``. ``mounts`` (jail
    only) are extra read-only paths, ``sys_path`` entries the child puts first on ``sys.path``.
    Never raises for anything the program does; infrastructure failures are "sandbox_error"."""
    limits = limits or SandboxLimits()
    limits.validate()
    total = len(tests)
    if not program.strip():
        return SandboxResult(0, total, "no_program")
    jail, why = resolve_jail(limits.jail)
    if jail == "unavailable":
        return SandboxResult(0, total, "sandbox_error", stderr_tail=why)
    private = Path(tempfile.mkdtemp(prefix="areal-sbx-io-"))  # 0700, the parent's own
    workdir = Path(tempfile.mkdtemp(prefix="areal-sbx-wd-")) if jail == "process" else None
    slot = _process_sandbox.SLOTS.acquire() if jail == "process" else None
    uid = (
        limits.uid_base + slot if slot is not None and limits.drop_privileges and os.geteuid() == 0 else None
    )
    nonce = secrets.token_hex(16)
    paths = {name: private / name for name in ("payload", "result", "stdout", "stderr")}
    try:
        result_fd = os.open(paths["result"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            payload = {
                "program": program, "inputs": [inp for inp, _ in tests], "nonce": nonce,
                "result_fd": result_fd, "uid": uid, "gid": uid, "audit": limits.audit_hook,
                "jailed": jail == "bwrap", "sys_path": list(sys_path),
                "limits": {name: int(getattr(limits, name)) for name in (
                    "cpu_seconds", "memory_bytes", "output_bytes", "max_processes", "max_open_files")},
            }  # fmt: skip
            paths["payload"].write_text(json.dumps(payload))
            with open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
                if jail == "bwrap":
                    exit_code, sig, timed_out, oom, layers = _run_in_jail(paths["payload"], out, err,
                                                                          result_fd, limits, mounts)  # fmt: skip
                else:
                    exit_code, sig, timed_out = _process_sandbox.run_child(
                        CHILD_SCRIPT, paths["payload"], out, err, workdir, result_fd, uid, limits.wall_seconds
                    )
                    oom, layers = False, ("process_sandbox",) + ((f"no_jail: {why}",) if why else ())
        finally:
            os.close(result_fd)
        return _judge(exit_code, sig, timed_out, oom, layers, paths, nonce, tests, limits)
    except Exception as exc:  # noqa: BLE001 - the trainer must get a verdict, never an exception
        return SandboxResult(0, total, "sandbox_error", stderr_tail=f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(private, ignore_errors=True)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if slot is not None:
            _process_sandbox.SLOTS.release(slot)


def _run_in_jail(payload_path, out, err, result_fd, limits, mounts):
    jail_limits = JailLimits(
        wall_seconds=limits.wall_seconds,
        cpu_seconds=limits.cpu_seconds + 1,  # the child's own RLIMIT_CPU fires first for one process
        memory_bytes=limits.memory_bytes,
        max_processes=limits.max_processes,
        file_bytes=limits.output_bytes,
        max_open_files=limits.max_open_files,
        tmp_bytes=max(limits.output_bytes, 8 << 20),
    )
    argv = [interpreter(), "-I", "-S", "-B", CHILD_IN_JAIL]
    all_mounts = [Mount(Path(CHILD_SCRIPT), CHILD_IN_JAIL), *mounts]
    with open(payload_path, "rb") as stdin:
        res = backend("bwrap").run(argv, all_mounts, jail_limits, cwd="/tmp", stdin=stdin, stdout=out,
                                   stderr=err, pass_fds=(result_fd,))  # fmt: skip
    if res.error:
        raise RuntimeError(f"jail failed to start: {res.error}")
    timed_out = res.timed_out or res.cpu_exceeded
    return res.exit_code, res.signal, timed_out, res.oom, res.layers


def _judge(exit_code, sig, timed_out, oom, layers, paths, nonce, tests, limits) -> SandboxResult:
    total = len(tests)
    stderr_tail = _tail(paths["stderr"], limits.stderr_tail_bytes)

    def fail(reason: str, extra=()) -> SandboxResult:
        return SandboxResult(0, total, reason, stderr_tail, tuple(layers) + tuple(extra))

    if oom:
        return fail("memory")
    if timed_out or sig in (signal.SIGXCPU, signal.SIGKILL):
        return fail("timeout")
    if sig == signal.SIGXFSZ:
        return fail("output_limit")
    if exit_code == BLOCKED_EXIT:
        return fail("blocked_syscall")
    if any(paths[p].stat().st_size >= limits.output_bytes for p in ("stdout", "stderr")):
        return fail("output_limit")
    size = paths["result"].stat().st_size
    raw = b"" if size > 4 * limits.output_bytes * max(1, total) + 4096 else paths["result"].read_bytes()
    frame = parse_frame(raw, nonce, total) if exit_code == 0 else None
    if frame is None:
        if exit_code != 0 and not raw:  # the child died without a word: only now is stderr a clue
            return fail("memory" if "MemoryError" in stderr_tail else "crash")
        return fail("protocol_error")
    child_layers = tuple(x for x in frame["layers"] if x not in layers)
    if frame["reason"]:
        return fail(frame["reason"], child_layers)
    passed, reason = score(frame, tests)
    return SandboxResult(passed, total, reason, stderr_tail, tuple(layers) + child_layers)


def _run_guarded(program, tests, limits) -> SandboxResult:
    try:
        return run_tests(program, tests, limits)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - one bad item must not take the batch (or the run) down
        return SandboxResult(0, len(tests), "sandbox_error", stderr_tail=f"{type(exc).__name__}: {exc}")


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
        return list(pool.map(lambda item: _run_guarded(item[0], item[1], limits), items))
