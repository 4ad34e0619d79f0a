"""Grading the field's way (SWE-bench, R2E-Gym), decoupled from how environments are started.

After an episode, :func:`grade` takes the agent's change as a diff of its repository copy against
the base tree (:func:`~areal_npu.agent.diffs.agent_diff`), drops every file that could decide how
the tests run (:func:`~areal_npu.agent.diffs.filter_diff`), applies the rest to a fresh copy of the
base (a patch that does not apply: reward 0, ``patch_failed``), restores the files the task's test
patch touches (and its hidden paths) from the base and applies the test patch over them, runs the
task's test command in a fresh environment (the caller's ``run``), and reads the log with the
official ``swebench`` 5 functions: ``get_logs_eval`` (with the pytest parser, or the task's
``log_parser``, from ``PARSER_REGISTRY``) -> ``get_eval_tests_report`` -> ``get_resolution_status``.
Reward 1.0 iff the resolution is full (every FAIL_TO_PASS and PASS_TO_PASS test passes). R2E-Gym
tasks (``CommandTests.expected_statuses``, from the row's ``expected_output_json``) score 1.0 iff
the parsed per-test statuses equal the expected ones (:func:`grade_r2e`).

What decides the reward, and why the agent cannot write it:

- the diff: git on the host with a private git directory and a fixed configuration; no exclude
  files, hooks, attributes, filters or text conversion from the trees, ``add --force``; the
  episode's own ``.git`` is never read as the repository (a nested one becomes a gitlink, dropped);
  symlinks stay symlinks, nothing is followed; binary files travel as binary patches;
- the filter: the test patch's files, test files (``tests/``, ``test/``, ``test_*.py``,
  ``*_test.py``), ``conftest.py``, ``sitecustomize.py`` / ``usercustomize.py``, ``*.pth``,
  ``*.dist-info`` / ``*.egg-info`` (entry points: pytest plugins), pytest configuration
  (``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml`` ...), bytecode and caches,
  virtualenvs and site-packages, top-level modules that would shadow the runner under ``python -m``
  (``pytest``, ``_pytest``, ``pluggy``, ``unittest``), the scripts the test command runs
  (:func:`command_scripts`: ``run_tests.sh``, ``bin/test``) and the task's hidden paths;
- the run: a fresh copy of the base plus the kept diff, under a clean environment
  (:data:`CLEAN_PREFIX`: no PYTHONPATH, PYTEST_ADDOPTS or PYTEST_PLUGINS, no user site, no bytecode
  writes). The episode's command outputs are no input at all: :func:`grade` has no parameter for them;
- the log is framed here, not in the environment: the command's output goes between swebench's
  start/end markers with the exit code the environment reported after them, and any ``>>>>>``
  marker the output prints is defused first. swebench rejects a log whose exit code is non-zero
  while every parsed test passed; a printed fake ``>>>>> Test Exit Code: 0`` cannot defeat that here
  (inside an eval script, as SWE-bench frames it, it would: ``parse_test_exit_code`` takes the first).

Pytest's plugin autoload stays on (no ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``): the plugins it finds are
the environment's own (its read-only site-packages), which real suites need (pytest-asyncio,
hypothesis, pytest-xdist, pytest-django ...); the agent's ways to add one (metadata beside the
sources, ``.pth``, ``sitecustomize``, ini ``addopts`` / ``pythonpath``, ``PYTEST_PLUGINS``) are
dropped or unset. Not protected, and inert: files nothing reads (``.env``). Implicit configuration
of another runner (a ``Makefile`` for ``make test``) is protected only when the task lists it in
``hidden_paths``.

The limit: the code under test runs in the test runner's own process (the SWE-bench and R2E-Gym
convention). A "fix" that, when imported, patches pytest (its report hooks), or prints the runner's
lines at exit and ends the process with status 0, is not prevented. Closing that needs the verdict
computed outside every process that runs agent code: tests that return values compared in a
process the code cannot reach (what :mod:`areal_npu.agent.sandbox` does for the embedded call
tests), or a runner whose per-test results travel over a channel the code under test cannot write
(a descriptor it never holds, under seccomp) to a reporter in another process. No field grader does
that today. Until then such diffs are flagged: ``details["suspicious"]`` lists the kept diff's added
lines that look like exit hooks, ``os._exit``, an exit at import or the runner's own output
(:func:`~areal_npu.agent.suspicious.suspicious_lines`); the workflow counts them and may zero the reward.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from areal_npu.agent.diffs import (
    FileChange,
    PrivateGit,
    agent_diff,
    filter_diff,
    is_protected,
    patch_paths,
    split_diff,
)
from areal_npu.agent.fs import copy_into_area, remove_tree, tree_usage
from areal_npu.agent.repo_task import CommandTests, GradeResult, RepoTask
from areal_npu.agent.suspicious import suspicious_lines

__all__ = [
    "CLEAN_PREFIX", "GRADING_ENV", "FileChange", "agent_diff", "command_scripts", "evaluate_log", "filter_diff",
    "grade", "grade_r2e", "is_protected", "parser_name", "patch_paths", "r2e_key", "split_diff",
]  # fmt: skip

# What the test command runs under, on every backend (the environments pass it as the command's env).
GRADING_ENV = {"PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
_UNSET = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTEST_ADDOPTS",
          "PYTEST_PLUGINS")  # fmt: skip
# Put before the task's test command: the same clean environment whatever the image's ENV says. A
# task that needs one of these variables sets it in its own test command (the task's, not the agent's).
CLEAN_PREFIX = f"unset {' '.join(_UNSET)}; export {' '.join(f'{k}={v}' for k, v in GRADING_ENV.items())}\n"
LOG_TAIL = 4000  # characters of the test log kept in GradeResult.details
# (max bytes, room bytes, room files) of the grading copy's area (fs.copy_into_area), and the bytes the
# episode's files may read beyond the base's (apparent sizes: holes and every hard link count in full)
DEFAULT_AREA = (1 << 30, 64 << 20, 20_000)

# (log, exit code or None when killed, details: {"timed_out": bool, "error": str, ...}); the
# environment backends' JailResult is accepted as well.
RunOutcome = tuple[str, "int | None", dict]
Runner = Callable[[str, Path], Any]


def _safe_relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"path {name!r} leaves the repository")
    return path


_INTERPRETER = re.compile(r"^(?:python[0-9.]*|bash|sh|dash|zsh|ksh|perl)$")


def command_scripts(command: str, base: Path) -> list[str]:
    """The base's files the test command runs as programs: an executable it names (``bin/test``,
    ``./tests/runtests.py``) or a file it hands an interpreter (``bash run_tests.sh``, ``python
    runtests.py``). A module it names as a test target (``pytest --doctest-modules calc.py``) is not
    one: the agent may have to fix it."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        words = command.split()
    found, expect_script, skip = [], False, False
    for word in words:
        if skip:  # the value of an interpreter option (python -W ignore)
            skip = False
            continue
        if expect_script and word.startswith("-"):
            skip = word in ("-W", "-X")
            expect_script = word not in ("-c", "-m")  # a command string or a module: no script file follows
            continue
        name = word.removeprefix("./")
        path = base / name
        if name and not name.startswith("/") and ".." not in PurePosixPath(name).parts and path.is_file():
            if expect_script or os.access(path, os.X_OK):
                found.append(name)
        expect_script = bool(_INTERPRETER.match(os.path.basename(word)))
    return found


def _venv_dirs(base: Path) -> list[str]:
    """Virtualenvs the base ships (R2E-Gym keeps one in the repository): their interpreters run the tests."""
    return [
        str(p.parent.relative_to(base))
        for pattern in ("*/pyvenv.cfg", "*/*/pyvenv.cfg")
        for p in base.glob(pattern)
    ]


def _make_parents(copy: Path, rel: PurePosixPath) -> None:
    """Every parent of ``rel`` under ``copy`` a real directory: a symlink or file there is removed first,
    so nothing written below is written through a link."""
    current = copy
    for part in rel.parts[:-1]:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            current.unlink()
        if not current.exists():
            current.mkdir()


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        remove_tree(path)


def _restore(copy: Path, base: Path, names: Iterable[str]) -> None:
    """Each of ``names`` in ``copy`` exactly as in ``base`` (absent when the base has none)."""
    for name in names:
        rel = _safe_relative(name)
        _make_parents(copy, rel)
        target, source = copy / rel, base / rel
        _remove(target)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif source.is_dir():
            shutil.copytree(source, target, symlinks=True)
        elif source.exists():
            shutil.copy2(source, target, follow_symlinks=False)


def _outcome(result: Any) -> RunOutcome:
    """``run``'s answer as (log, exit code, details): a tuple, or a JailResult from the backends."""
    if isinstance(result, tuple):
        log, code, details = result
        return str(log), code, dict(details or {})
    details = {k: v for k in ("timed_out", "cpu_exceeded", "oom", "disk_exceeded", "process_limit", "signal", "error")
               if (v := getattr(result, k, None))}  # fmt: skip
    details["layers"] = list(getattr(result, "layers", ()))
    if getattr(result, "output_total", 0) > len(result.output):
        details["log_truncated"] = True
    return result.output.decode("utf-8", "replace"), result.exit_code, details


def parser_name(log_parser: str) -> str:
    """swebench's registry name for a task's ``log_parser`` (``pytest`` or ``parse_log_pytest``)."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    for name in (log_parser, f"parse_log_{log_parser}"):
        if name in PARSER_REGISTRY:
            return name
    raise ValueError(
        f"log_parser {log_parser!r} is not one of swebench's parsers: {', '.join(sorted(PARSER_REGISTRY))}"
    )


def r2e_key(test_id: str) -> str:
    """A test id as R2E-Gym records it in ``expected_output_json``: the file dropped, classes and
    function joined by dots (``r2e_tests/test_1.py::TestX::test_y`` -> ``TestX.test_y``), no colour."""
    test_id = re.sub(r"\x1b\[[0-9;]*m", "", test_id).split(" - ", 1)[0]
    return ".".join(test_id.split("::")[1:]) if "::" in test_id else test_id


R2E_STATUSES = ("PASSED", "FAILED", "ERROR")  # what R2E-Gym's log reading records; skips/xfails are not


def evaluate_log(
    log: str, exit_code: int | None, tests: CommandTests, timed_out: bool = False
) -> tuple[float, dict]:
    """``(reward, details)`` of one test run's output with swebench's functions. The log is framed here:
    markers the output prints are defused, and the exit code the environment reported is recorded
    after the end marker, where swebench's cross-check reads it."""
    from swebench.harness import grading as swe  # imports its whole harness: 2-4 s the first time
    from swebench.harness.constants import (
        END_TEST_OUTPUT,
        FAIL_TO_PASS,
        PASS_TO_PASS,
        START_TEST_OUTPUT,
        TEST_EXIT_CODE,
        TESTS_ERROR,
        TESTS_TIMEOUT,
        EvalType,
        ResolvedStatus,
    )
    from swebench.types import TestSpec

    spec = TestSpec(instance_id="areal-npu", image="", eval_script_list=[], repo="", version="",
                    FAIL_TO_PASS=list(tests.fail_to_pass), PASS_TO_PASS=list(tests.pass_to_pass),
                    log_parser=parser_name(tests.log_parser), eval_type=EvalType.PASS_AND_FAIL.value)  # fmt: skip
    body = log.replace(">>>>>", ">>>> >")
    if exit_code is None:
        trailer = TESTS_TIMEOUT if timed_out else TESTS_ERROR
    else:
        trailer = f"{TEST_EXIT_CODE}: {exit_code}"
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".log") as fh:
        fh.write(f"{START_TEST_OUTPUT}\n{body}\n{END_TEST_OUTPUT}\n{trailer}\n")
        fh.flush()
        statuses, found = swe.get_logs_eval(spec, fh.name)
    if not found:
        reason = "log_invalid" if exit_code is not None else "tests_timeout" if timed_out else "tests_killed"
        return 0.0, {"reason": reason, "statuses": {}}
    if tests.expected_statuses is not None:
        got = {r2e_key(k): v for k, v in statuses.items() if v in R2E_STATUSES}
        want = {r2e_key(k): v for k, v in tests.expected_statuses.items()}
        got.pop("", None), want.pop("", None)
        mismatched = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        reward = 1.0 if want and not mismatched else 0.0
        return reward, {"reason": "resolved" if reward else "unresolved", "statuses": statuses,
                        "expected": len(want), "matched": len(want) - len(set(mismatched) & set(want)),
                        "mismatched": mismatched[:50], "passed": len(want) - len(set(mismatched) & set(want)),
                        "total": len(want)}  # fmt: skip
    report = swe.get_eval_tests_report(statuses, {FAIL_TO_PASS: list(tests.fail_to_pass),
                                                  PASS_TO_PASS: list(tests.pass_to_pass)})  # fmt: skip
    resolution = swe.get_resolution_status(report)
    reward = 1.0 if resolution == ResolvedStatus.FULL.value else 0.0
    counts = {key: {"passed": len(report[name]["success"]), "total": len(ids), "failed": report[name]["failure"][:50]}
              for key, name, ids in (("f2p", FAIL_TO_PASS, tests.fail_to_pass),
                                     ("p2p", PASS_TO_PASS, tests.pass_to_pass))}  # fmt: skip
    # passed / total: the hidden tests (FAIL_TO_PASS and PASS_TO_PASS) that pass, as the episode stats read them
    return reward, {"reason": "resolved" if reward else "unresolved", "resolution": resolution, "statuses": statuses,
                    "passed": counts["f2p"]["passed"] + counts["p2p"]["passed"],
                    "total": counts["f2p"]["total"] + counts["p2p"]["total"], **counts}  # fmt: skip


def grade(task: RepoTask, base: Path, episode: Path, run: Runner, workdir: Path | None = None,
          area: tuple[int, int, int] = DEFAULT_AREA) -> GradeResult:  # fmt: skip
    """Grade the episode's repository copy ``episode`` against the base tree ``base`` (which holds the
    task's hidden paths, if any: the grading copy takes them from it). ``run(command, repo)`` runs one
    shell command in a FRESH environment with ``repo`` as its work dir and returns ``(log, exit code or
    None, details)`` (or a JailResult). Task errors (a malformed test patch, an unknown log parser, no
    tests) raise ValueError before anything runs; everything the episode causes is a reason in the
    details: ``resolved``, ``unresolved``, ``diff_failed``, ``patch_failed``, ``test_patch_failed``,
    ``run_error``, ``log_invalid``, ``tests_timeout``, ``tests_killed``, ``too_large`` (the episode's
    files read more than ``area[0]`` bytes beyond the base's, holes and hard links counted in full:
    nothing is read or copied). The grading copy is made in an area
    (:func:`areal_npu.agent.fs.copy_into_area`) where this process can mount one: room for what the
    episode added, plus ``area[1]`` bytes and ``area[2]`` files for the tests."""
    tests = task.hidden_tests
    if not isinstance(tests, CommandTests):
        raise ValueError(f"task {task.task_id!r}: grading needs command tests, not call tests")
    if tests.expected_statuses is None and not (tests.fail_to_pass or tests.pass_to_pass):
        raise ValueError(f"task {task.task_id!r}: FAIL_TO_PASS and PASS_TO_PASS are both empty")
    if tests.expected_statuses is not None and not tests.expected_statuses:
        raise ValueError(f"task {task.task_id!r}: expected_output_json is empty")
    parser_name(tests.log_parser)
    base, episode = Path(base), Path(episode)
    start = time.monotonic()
    test_files = [*patch_paths(tests.patch), *tests.files]
    for name in [*test_files, *tests.hidden_paths]:
        _safe_relative(name)
    seconds: dict[str, float] = {}
    details: dict[str, Any] = {"dropped_paths": [], "seconds": seconds}

    def done(reward: float, reason: str, **more) -> GradeResult:
        seconds["total"] = time.monotonic() - start
        details.update(more, reason=reason)
        return GradeResult(reward, details)

    protected = [*test_files, *tests.hidden_paths, *command_scripts(tests.command, base), *_venv_dirs(base)]
    (episode_bytes, episode_files), (base_bytes, base_files) = (
        tree_usage(p, apparent=True) for p in (episode, base)
    )
    grown, new_files = max(0, episode_bytes - base_bytes), max(0, episode_files - base_files)
    if grown > area[0]:
        return done(0.0, "too_large", apparent_bytes_added=grown)
    try:
        diff = agent_diff(base, episode)
    except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
        return done(0.0, "diff_failed", error=str(exc)[-2000:])
    kept, dropped = filter_diff(diff, protected)
    seconds["diff"] = time.monotonic() - start
    details.update(dropped_paths=dropped, diff_bytes=len(diff), kept_bytes=len(kept),
                   suspicious=[str(f) for f in suspicious_lines(kept)])  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="areal-grading-", dir=workdir))
    try:
        copy = tmp / "repo"
        # room for the kept diff (at most what the episode added) and the tests
        details["grading_area"] = copy_into_area(base, copy, area[0], grown + area[1], new_files + area[2])
        with PrivateGit() as git:
            error = git.apply(copy, kept)
            if error:
                return done(0.0, "patch_failed", apply_error=error[-2000:])
            _restore(copy, base, [*test_files, *tests.hidden_paths])
            for name, text in tests.files.items():
                rel = _safe_relative(name)
                _make_parents(copy, rel)
                _remove(copy / rel)
                (copy / rel).write_text(text)
            error = git.apply(copy, tests.patch)
            if error:
                return done(0.0, "test_patch_failed", apply_error=error[-2000:])
        seconds["apply"] = time.monotonic() - start - seconds["diff"]
        tests_start = time.monotonic()
        log, exit_code, run_details = _outcome(run(CLEAN_PREFIX + tests.command, copy))
        seconds["tests"] = time.monotonic() - tests_start
    finally:
        remove_tree(tmp)
    more = {"exit_code": exit_code, "log_tail": log[-LOG_TAIL:], "run": run_details}
    if run_details.get("error"):
        return done(0.0, "run_error", **more)
    timed_out = bool(run_details.get("timed_out") or run_details.get("cpu_exceeded"))
    reward, verdict = evaluate_log(log, exit_code, tests, timed_out)
    return done(reward, verdict.pop("reason"), **verdict, **more)


def grade_r2e(
    task: RepoTask, base: Path, episode: Path, run: Runner, workdir: Path | None = None
) -> GradeResult:
    """:func:`grade` for an R2E-Gym row (``CommandTests.expected_statuses`` from its
    ``expected_output_json``; its ``run_tests.sh`` and ``r2e_tests/`` are hidden paths the base holds):
    reward 1.0 iff the parsed per-test statuses equal the expected ones."""
    if not isinstance(task.hidden_tests, CommandTests) or task.hidden_tests.expected_statuses is None:
        raise ValueError(f"task {task.task_id!r} is not an R2E-Gym task (no expected_output_json)")
    return grade(task, base, episode, run, workdir)
