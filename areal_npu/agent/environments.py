"""Repository environments in the R2E-Gym / SWE-Gym style: a task is a repository snapshot, a
problem statement and hidden tests; an episode is a throw-away jailed copy of the repository.

``RepoEnv(task).reset()`` makes the copy; ``run(command, timeout)`` runs one shell command in it
(each command is its own jail: files persist between commands, processes never do);
``grade()`` runs the hidden tests, which exist in the jail only for that step; ``close()`` removes
the copy. The copy is a size-capped area (:mod:`areal_npu.agent.fs`: bytes and inodes, a tmpfs)
where the trainer may mount one, so no command can take more of the host than ``disk_bytes`` and
``disk_files``; elsewhere its size is polled. Nothing an episode does can raise in the caller:
failures come back as output, exit codes and ``GradeResult.details``.

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

import shutil
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from areal_npu.agent import env_backends, fs, grading
from areal_npu.agent.env_backends import EnvBackend
from areal_npu.agent.fs import remove_tree as _remove_tree
from areal_npu.agent.jail import JailLimits, Mount
from areal_npu.agent.repo_task import REPO_IN_JAIL, CallTest, CommandTests, GradeResult, RepoTask
from areal_npu.agent.sandbox import SandboxLimits, run_tests
from areal_npu.agent.warm_pool import WarmPool

# Bytecode goes to the private /tmp, never beside the sources: a cache left in the repository by one
# command could otherwise shadow a same-size edit made within the same second.
_PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/tmp/.pycache"}
_ENGINES = env_backends.CONTAINER_TOOLS  # they limit a container's tree in their own control group
TIMEOUT_EXIT = 124  # what coreutils' timeout returns; the note in the output says so too
# Imports the repository (first on sys.path in the grading child) and calls one function.
CALL_DRIVER = (
    "def f(call):\n"
    "    module, function, args = call\n"
    "    return getattr(__import__(module, fromlist=['_']), function)(*args)\n"
)


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


def area_sizes(limits: JailLimits) -> tuple[int, int, int]:
    """What an episode's repository copy (or a grading copy) may hold, as
    :func:`areal_npu.agent.fs.copy_into_area` takes it: ``(max bytes, room bytes, room files)``."""
    return int(limits.disk_bytes), int(limits.file_bytes), int(limits.disk_files)


def make_base(task: RepoTask, dest: Path, env_backend: EnvBackend) -> None:
    """Fill the empty ``dest`` with the task's base repository: its snapshot, or the tree its image
    ships at the work dir (hidden paths included: grading takes them from here)."""
    if task.snapshot is not None:
        materialize(task.snapshot, dest)
    elif task.image:
        env_backend.export_repo(task.image, task.workdir, dest)
    else:
        raise ValueError(f"task {task.task_id!r} has neither a snapshot nor an image")


def hide_paths(task: RepoTask, repo: Path) -> None:
    """Remove from an episode's copy what the agent must not see (R2E-Gym's run_tests.sh, r2e_tests/)."""
    hidden = task.hidden_tests.hidden_paths if isinstance(task.hidden_tests, CommandTests) else ()
    for name in hidden:
        target = repo / _safe_relative(name)
        if target.is_dir() and not target.is_symlink():
            _remove_tree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


class RepoEnv:
    """One episode of one task. Use as a context manager, or call ``close()``. ``backend``: a name or an
    :class:`~areal_npu.agent.env_backends.EnvBackend`; ``pool``: where prepared repository copies come
    from (the task's base tree is made here when there is none)."""

    def __init__(self, task: RepoTask, limits: EnvLimits | None = None, backend: str | EnvBackend = "bwrap",
                 pool: WarmPool | None = None):  # fmt: skip
        self.task, self.limits = task, limits or EnvLimits()
        self.limits.validate()
        self.backend = env_backends.get(backend) if isinstance(backend, str) else backend
        self.pool = pool
        self.root: Path | None = None  # the episode's own directory (its repository copy, its base when no pool)
        self.seconds_left = self.limits.episode_seconds
        self.start_seconds = 0.0  # how long reset() waited for the environment
        self.layers: set[str] = set()  # what held for every command of the episode (limits_held)
        self.commands = 0

    @property
    def repo(self) -> Path:
        if self.root is None:
            raise RuntimeError("reset() first")
        return self.root / "repo"

    def _base(self) -> Path:
        return self.pool.base(self.task) if self.pool is not None else self.repo.parent / "base"

    def reset(self) -> str:
        """A fresh copy of the repository; returns the problem statement."""
        self.close()
        start = time.monotonic()
        ok, why = self.backend.available()
        if not ok:
            raise RuntimeError(f"the {self.backend.name} environment backend cannot start here: {why}")
        self.root = Path(tempfile.mkdtemp(prefix="areal-episode-"))
        sizes = area_sizes(self.limits.command)
        if self.pool is not None:
            copy, _ = self.pool.take(self.task)
            fs.move_tree(copy.parent, self.root)
            if fs.area_of(self.repo) is None and fs.areas_supported()[0]:  # a pool of plain copies
                self.repo.rename(self.root / "plain")
                fs.copy_into_area(self.root / "plain", self.repo, *sizes)
                _remove_tree(self.root / "plain")
        else:
            (self.root / "base").mkdir()
            make_base(self.task, self.root / "base", self.backend)
            fs.copy_into_area(self.root / "base", self.repo, *sizes)
        hide_paths(self.task, self.repo)
        self.seconds_left = self.limits.episode_seconds
        self.layers, self.commands = set(), 0
        self.start_seconds = time.monotonic() - start
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
            note = f"its size limit ({limits.disk_bytes >> 20} MiB or {limits.disk_files} new files)"
            return text + f"\n[the repository reached {note}; the command was killed]", 1
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
        res = self.backend.run(command, repo, limits, self.task.image, self.task.workdir, _PYTHON_ENV)
        self.seconds_left -= time.monotonic() - start
        if not res.error:
            held = {"cgroup"} if any(x.startswith("cgroup_") or x in _ENGINES for x in res.layers) else set()
            held |= {"disk_area"} & set(res.layers)
            self.layers = held if self.commands == 0 else self.layers & held
            self.commands += 1
        return self._format(res, limits)

    def limits_held(self) -> dict[str, int]:
        """``{"cgroup": 0/1, "disk_area": 0/1}``: 1 when every command of the episode so far ran in a
        control group (a container engine's count) / on a size-capped repository copy; 0 before any ran."""
        return {name: int(name in self.layers) for name in ("cgroup", "disk_area")}

    def grade(self) -> GradeResult:
        """Grade the repository as it is now: hidden call tests, or the SWE-bench way
        (:func:`areal_npu.agent.grading.grade`, in fresh environments). Reward 1.0 when resolved."""
        self.repo  # noqa: B018 - raises before reset()
        start = time.monotonic()
        try:
            if isinstance(self.task.hidden_tests, CommandTests):
                result = grading.grade(self.task, self._base(), self.repo, self._grading_run,
                                       area=area_sizes(self.limits.grading))  # fmt: skip
            else:
                result = self._grade_calls(self.task.hidden_tests)
        except Exception as exc:  # noqa: BLE001 - a broken task or jail is reward 0, not a crash
            result = GradeResult(0.0, {"reason": "sandbox_error", "error": f"{type(exc).__name__}: {exc}"})
        result.details["grade_seconds"] = time.monotonic() - start
        return result

    def _grading_run(self, command: str, repo: Path):
        res = self.backend.run(command, repo, self.limits.grading, self.task.image, self.task.workdir,
                               grading.GRADING_ENV)  # fmt: skip
        return res

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

    def close(self) -> None:
        if self.root is not None:
            _remove_tree(self.root)
            self.root = None

    def __enter__(self) -> RepoEnv:
        self.reset()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
