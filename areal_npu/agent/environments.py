"""Repository environments in the R2E-Gym / SWE-Gym style: a task is a repository snapshot, a
problem statement and hidden tests; an episode is a throw-away jailed copy of the repository.

``RepoEnv(task).reset()`` makes the copy; ``run(command, timeout)`` runs one shell command in it
(each command is its own jail: files persist between commands, processes never do);
``grade()`` runs the hidden tests, which exist in the jail only for that step; ``close()`` removes
the copy. Nothing an episode does can raise in the caller: failures come back as output, exit codes
and ``GradeResult.details``.

Hidden tests come in two kinds:

- ``CallTest`` tuples (the embedded tasks): the jail imports the repository and reports what each
  call returned; the expected values never enter the jail and the comparison happens here, so
  code under test cannot fake a pass (:mod:`areal_npu.agent.sandbox`'s protocol);
- ``CommandTests`` (real task sets): hidden test files / a test patch are put into a separate
  grading copy, the task's command runs there, and its log decides. That is as trustworthy as the
  repository's own test runner (the code under test runs in the same process as the tests), which
  is the SWE-bench convention.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from areal_npu.agent.jail import JailLimits, Mount, backend
from areal_npu.agent.sandbox import SandboxLimits, run_tests

REPO_IN_JAIL = "/repo"
HIDDEN_IN_JAIL = "/hidden"
# Bytecode goes to the private /tmp, never beside the sources: a cache left in the repository by one
# command could otherwise shadow a same-size edit made within the same second.
_PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/tmp/.pycache"}
TIMEOUT_EXIT = 124  # what coreutils' timeout returns; the note in the output says so too
# Imports the repository (first on sys.path in the grading child) and calls one function.
CALL_DRIVER = (
    "def f(call):\n"
    "    module, function, args = call\n"
    "    return getattr(__import__(module, fromlist=['_']), function)(*args)\n"
)


@dataclass(frozen=True)
class CallTest:
    module: str
    function: str
    args: Any  # list of positional arguments (plain JSON)
    expected: Any


@dataclass(frozen=True)
class CommandTests:
    command: str  # run in the grading copy's root
    files: Mapping[str, str] = field(default_factory=dict)  # hidden test files: repo path -> text
    patch: str = ""  # a unified diff adding the hidden tests (SWE-bench test_patch), applied with git
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()


@dataclass(frozen=True)
class RepoTask:
    task_id: str
    problem_statement: str
    snapshot: Path | Mapping[str, str]  # a directory, a .tar(.gz)/.tgz/.zip archive, or files
    hidden_tests: tuple[CallTest, ...] | CommandTests
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class GradeResult:
    reward: float
    details: dict[str, Any]


def _safe_relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"snapshot path {name!r} leaves the repository")
    return path


def materialize(snapshot: Path | Mapping[str, str], dest: Path) -> None:
    """Write a snapshot into the empty directory ``dest`` (archive members may not leave it)."""
    if isinstance(snapshot, Mapping):
        for name, text in snapshot.items():
            target = dest / _safe_relative(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return
    snapshot = Path(snapshot)
    if snapshot.is_dir():
        shutil.copytree(snapshot, dest, symlinks=True, dirs_exist_ok=True)
    elif zipfile.is_zipfile(snapshot):
        with zipfile.ZipFile(snapshot) as archive:
            for name in archive.namelist():
                _safe_relative(name.rstrip("/") or ".")
            archive.extractall(dest)
    elif tarfile.is_tarfile(snapshot):
        with tarfile.open(snapshot) as archive:
            if hasattr(tarfile, "data_filter"):  # 3.10.12+/3.11.4+: refuses links and paths outside
                archive.extractall(dest, filter="data")
            else:
                members = archive.getmembers()
                for m in members:
                    _safe_relative(m.name)
                    if not (m.isfile() or m.isdir()):
                        raise ValueError(f"archive member {m.name!r} is not a plain file or directory")
                archive.extractall(dest, members=members)
    else:
        raise ValueError(f"snapshot {snapshot} is neither a directory nor a tar/zip archive")


def _remove_tree(path: Path) -> None:
    """Remove a tree a jailed program may have made unwritable (chmod 000 directories)."""

    def make_writable_and_retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), stat.S_IRWXU)
            os.chmod(target, stat.S_IRWXU)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)


_PYTEST_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)", re.M)
_PYTEST_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)", re.M)
_UNITTEST_VERBOSE = re.compile(r"^(\w+ \([\w.]+\)) \.\.\. (ok|FAIL|ERROR|skipped|expected failure)", re.M)


def parse_test_log(log: str) -> dict[str, str]:
    """``{test id: "PASSED" | "FAILED" | ...}`` from pytest ``-rA`` / ``-v`` or unittest ``-v`` output.
    Test ids are as the runner prints them (``tests/test_x.py::test_y``; ``test_y (mod.Class.test_y)``)."""
    statuses: dict[str, str] = {}
    for status, test in _PYTEST_STATUS.findall(log):
        statuses[test] = status
    for test, status in _PYTEST_VERBOSE.findall(log):
        statuses.setdefault(test, status)
    unittest_names = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "skipped": "SKIPPED",
                      "expected failure": "XFAIL"}  # fmt: skip
    for test, status in _UNITTEST_VERBOSE.findall(log):
        statuses.setdefault(test, unittest_names[status])
    return statuses


@dataclass
class EnvLimits:
    command: JailLimits = field(default_factory=lambda: JailLimits(wall_seconds=30, cpu_seconds=30))
    grading: JailLimits = field(default_factory=lambda: JailLimits(wall_seconds=120, cpu_seconds=120,
                                                                   output_bytes=4 << 20))  # fmt: skip
    episode_seconds: float = 1800.0  # wall clock for all of an episode's commands together

    def validate(self) -> None:
        self.command.validate()
        self.grading.validate()
        if not self.episode_seconds > 0:
            raise ValueError("episode_seconds must be > 0")


class RepoEnv:
    """One episode of one task. Use as a context manager, or call ``close()``."""

    def __init__(self, task: RepoTask, limits: EnvLimits | None = None, jail: str = "bwrap"):
        self.task, self.limits = task, limits or EnvLimits()
        self.limits.validate()
        self.jail = backend(jail)
        self.root: Path | None = None
        self.seconds_left = self.limits.episode_seconds

    @property
    def repo(self) -> Path:
        if self.root is None:
            raise RuntimeError("reset() first")
        return self.root / "repo"

    def reset(self) -> str:
        """A fresh copy of the repository; returns the problem statement."""
        self.close()
        ok, why = self.jail.available()
        if not ok:
            raise RuntimeError(f"no jail for environments here: {why}")
        self.root = Path(tempfile.mkdtemp(prefix="areal-episode-"))
        (self.root / "repo").mkdir()
        materialize(self.task.snapshot, self.root / "repo")
        self.seconds_left = self.limits.episode_seconds
        return self.task.problem_statement

    def _format(self, res, limits: JailLimits) -> tuple[str, int]:
        text = res.output.decode("utf-8", "replace")
        if res.output_total > len(res.output):
            half = len(res.output) // 2
            head = res.output[:half].decode("utf-8", "replace")
            tail = res.output[half:].decode("utf-8", "replace")
            text = f"{head}\n[... {res.output_total - len(res.output)} bytes of output omitted ...]\n{tail}"
        if res.error:
            return f"[the environment failed to run the command: {res.error}]", 1
        if res.timed_out:
            return text + f"\n[the command ran past {limits.wall_seconds:g} s and was killed]", TIMEOUT_EXIT
        if res.cpu_exceeded:
            return (
                text + f"\n[the command used its {limits.cpu_seconds:g} CPU seconds and was killed]",
                TIMEOUT_EXIT,
            )
        if res.disk_exceeded:
            return text + f"\n[the repository grew past {limits.disk_bytes >> 20} MiB; the command was killed]", 1
        if res.oom:
            return text + f"\n[the command went past {limits.memory_bytes >> 20} MiB and was killed]", 137
        return text, res.exit_code if res.exit_code is not None else 128 + (res.signal or 0)

    def run(self, command: str, timeout: float | None = None) -> tuple[str, int]:
        """Run ``command`` with ``/bin/sh -c`` in the repository; ``(output, exit code)``. Output is
        stdout and stderr together, head and tail kept with a note when it was longer."""
        repo = self.repo
        if self.seconds_left <= 0:
            return "[the episode's time is up; no more commands run]", TIMEOUT_EXIT
        wall = min(timeout or self.limits.command.wall_seconds, self.limits.command.wall_seconds,
                   self.seconds_left)  # fmt: skip
        limits = replace(self.limits.command, wall_seconds=wall)
        start = time.monotonic()
        res = self.jail.run(["/bin/sh", "-c", command], [Mount(repo, REPO_IN_JAIL, writable=True)], limits,
                            cwd=REPO_IN_JAIL, env=_PYTHON_ENV)  # fmt: skip
        self.seconds_left -= time.monotonic() - start
        return self._format(res, limits)

    def grade(self) -> GradeResult:
        """Run the hidden tests against the repository as it is now. Reward 1.0 when all pass."""
        self.repo  # noqa: B018 - raises before reset()
        try:
            if isinstance(self.task.hidden_tests, CommandTests):
                return self._grade_command(self.task.hidden_tests)
            return self._grade_calls(self.task.hidden_tests)
        except Exception as exc:  # noqa: BLE001 - a broken task or jail is reward 0, not a crash
            return GradeResult(0.0, {"reason": "sandbox_error", "error": f"{type(exc).__name__}: {exc}"})

    def _grade_calls(self, tests: tuple[CallTest, ...]) -> GradeResult:
        g = self.limits.grading
        limits = SandboxLimits(cpu_seconds=int(max(1, g.cpu_seconds)), wall_seconds=g.wall_seconds,
                               memory_bytes=g.memory_bytes, max_processes=g.max_processes,
                               audit_hook=False, jail="bwrap")  # fmt: skip
        pairs = [((t.module, t.function, list(t.args)), t.expected) for t in tests]
        res = run_tests(CALL_DRIVER, pairs, limits, mounts=[Mount(self.repo, REPO_IN_JAIL)],
                        sys_path=[REPO_IN_JAIL])  # fmt: skip
        reward = 1.0 if res.reason == "ok" else 0.0
        return GradeResult(reward, {"reason": res.reason, "passed": res.passed, "total": res.total,
                                    "fraction": res.fraction, "layers": res.layers})  # fmt: skip

    def _grade_command(self, tests: CommandTests) -> GradeResult:
        grading = Path(tempfile.mkdtemp(prefix="areal-grading-"))
        try:
            copy, hidden = grading / "repo", grading / "hidden"
            shutil.copytree(self.repo, copy, symlinks=True)
            hidden.mkdir()
            for name, text in tests.files.items():
                target = copy / _safe_relative(name)
                if target.is_symlink() or target.is_file():  # the agent may have planted a link there
                    target.unlink()
                elif target.is_dir():
                    _remove_tree(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
            command = tests.command
            if tests.patch:
                (hidden / "test.patch").write_text(tests.patch)
                command = f"git apply {HIDDEN_IN_JAIL}/test.patch && {command}"
            res = self.jail.run(["/bin/sh", "-c", command],
                                [Mount(copy, REPO_IN_JAIL, writable=True), Mount(hidden, HIDDEN_IN_JAIL)],
                                self.limits.grading, cwd=REPO_IN_JAIL, env=_PYTHON_ENV)  # fmt: skip
        finally:
            _remove_tree(grading)
        log = res.output.decode("utf-8", "replace")
        statuses = parse_test_log(log)
        wanted = tuple(tests.fail_to_pass) + tuple(tests.pass_to_pass)
        if wanted:
            passed = [t for t in wanted if statuses.get(t) in ("PASSED", "XFAIL")]
            reward = 1.0 if len(passed) == len(wanted) and not res.timed_out else 0.0
        else:
            passed, reward = [], 1.0 if res.exit_code == 0 else 0.0
        return GradeResult(reward, {"reason": "ok" if reward == 1.0 else "tests_failed",
                                    "exit_code": res.exit_code, "timed_out": res.timed_out,
                                    "passed": len(passed), "total": len(wanted), "statuses": statuses,
                                    "log_tail": log[-2000:], "layers": res.layers})  # fmt: skip

    def close(self) -> None:
        if self.root is not None:
            _remove_tree(self.root)
            self.root = None

    def __enter__(self) -> RepoEnv:
        self.reset()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
