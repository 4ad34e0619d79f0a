"""Running a library's own test suite and reading its verdicts, the SWE-bench way.

A runner is ``run_suite(repo_dir, command, timeout=None) -> (log, exit_code)``: the command runs in
the repository's top folder. Two are provided: :func:`jail_runner` (bubblewrap, on the task set's
environment root filesystem when one is given: the tests then run where they will be graded) and
:func:`host_runner` (this machine's interpreter first on PATH; for building without a root
filesystem). Logs are read with swebench's own ``parse_log_pytest`` (pytest ``-rA`` summary lines),
so the ids written into a task are exactly the ids its grader will look for.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

from swebench.harness.log_parsers import PARSER_REGISTRY

from areal_npu.agent.jail import JailLimits, Mount, backend

LOG_PARSER = "parse_log_pytest"  # swebench's name for it, written into every row
TIMEOUT_EXIT = 124
Runner = Callable[..., tuple[str, int]]  # (repo_dir, command, timeout=None) -> (log, exit_code)
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)
_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$", re.M)
_BANNER = re.compile(r"^={3,} .* ={3,}$", re.M)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object reprs: differ run to run, would make the text unstable
# pytest's assertion detail below the first "+  where": intermediate values (clock readings, ids), noise
_NESTED_WHERE = re.compile(r"^E\s+\+ {3,}where ")
_SUITE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "160", "LANG": "C.UTF-8"}


def host_runner(python: str = sys.executable, timeout_s: float = 600.0) -> Runner:
    """Runs the command with ``sh -c`` on this machine, ``python``'s folder first on PATH and none of
    the caller's PYTHON* variables; a run past its timeout is killed with its whole process group."""

    def run_suite(repo_dir: Path, command: str, timeout: float | None = None) -> tuple[str, int]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(_SUITE_ENV, PATH=f"{os.path.dirname(python)}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=repo_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout or timeout_s)
            return out.decode("utf-8", "replace"), proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()  # the pipe closes once the whole group is gone
            note = f"\n[timed out after {timeout or timeout_s:.0f} s]\n"
            return out.decode("utf-8", "replace") + note, TIMEOUT_EXIT
        finally:  # whatever the suite left running in its group goes too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    return run_suite


def jail_runner(root: Path | None = None, limits: JailLimits | None = None) -> Runner:
    """Runs the command in the bubblewrap jail: the repository writable at /testbed, on ``root`` (the
    task set's environment root filesystem) when given, else on the host's /usr. A jail that cannot
    start raises: a build must not quietly fall back to another Python."""
    jail = backend("bwrap")
    base = limits or JailLimits(wall_seconds=600, cpu_seconds=600, memory_bytes=2 << 30, output_bytes=16 << 20,
                                max_processes=256)  # fmt: skip

    def run_suite(repo_dir: Path, command: str, timeout: float | None = None) -> tuple[str, int]:
        lim = base
        if timeout:
            lim = JailLimits(**{**vars(base), "wall_seconds": timeout, "cpu_seconds": timeout})
        res = jail.run(["/bin/sh", "-c", command], [Mount(Path(repo_dir), "/testbed", writable=True)], lim,
                       cwd="/testbed", env={**_SUITE_ENV, "HOME": "/tmp"}, root=root)  # fmt: skip
        if res.error:
            raise RuntimeError(f"the jail could not run the suite in {repo_dir}: {res.error}")
        log = res.output.decode("utf-8", "replace")
        if res.timed_out or res.cpu_exceeded:
            return log + "\n[timed out]\n", TIMEOUT_EXIT
        return log, res.exit_code if res.exit_code is not None else 128 + (res.signal or 0)

    return run_suite


def parse_statuses(log: str) -> dict[str, str]:
    """``{test id: status}`` by swebench's pytest parser, less any id the summary prints more than once
    (a parametrized id with a space is cut at the space, and two such tests would share one name:
    neither can be graded reliably)."""
    parsed = PARSER_REGISTRY[LOG_PARSER](log, None)
    counts = Counter(name for _status, name in _SUMMARY.findall(log))
    return {name: status for name, status in parsed.items() if counts.get(name, 1) == 1}


def test_file(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def in_paths(path: str, roots: Iterable[str]) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(r) or PurePosixPath(r) in p.parents for r in roots)


def split_tests(baseline: set[str], mutated: dict[str, str], test_paths: tuple[str, ...], max_fail: int
                ) -> tuple[list[str], list[str], str]:  # fmt: skip
    """SWE-smith's filter: FAIL_TO_PASS = baseline passers that do not pass with the bug (a test that
    vanished from the log, e.g. its module no longer imports, counts as failing); PASS_TO_PASS = the
    baseline passers that still pass. Returns ``(f2p, p2p, why_rejected)``, ``why`` empty when kept:
    no test failed, more than ``max_fail`` failed, or one failed outside ``test_paths`` (a doctest in
    the source itself cannot be hidden from the agent)."""
    f2p = sorted(t for t in baseline if mutated.get(t) != "PASSED")
    p2p = sorted(t for t in baseline if mutated.get(t) == "PASSED")
    if not f2p:
        return f2p, p2p, "no test failed"
    if len(f2p) > max_fail:
        return f2p, p2p, "too many tests failed"
    if any(not in_paths(test_file(t), test_paths) for t in f2p):
        return f2p, p2p, "a failing test is outside the suite's paths"
    return f2p, p2p, ""


def cap_pass_to_pass(p2p: list[str], hidden_files: set[str], limit: int, seed: int) -> list[str]:
    """At most ``limit`` ids: every one in the hidden files first (they sit beside the failing tests),
    then a seeded sample of the rest; sorted."""
    near = sorted(t for t in p2p if test_file(t) in hidden_files)
    far = sorted(t for t in p2p if test_file(t) not in hidden_files)
    if len(near) >= limit:
        return sorted(random.Random(seed).sample(near, limit))
    return sorted(near + random.Random(seed).sample(far, min(len(far), limit - len(near))))


def _failures_area(log: str) -> str:
    start = re.search(r"^=+ FAILURES =+$", log, re.M)
    if not start:
        return ""
    end = _BANNER.search(log, start.end())
    return log[start.end() : end.start() if end else len(log)]


def failure_excerpt(log: str, test_id: str, max_lines: int = 12, width: int = 160) -> str:
    """What the failing test shows in pytest's FAILURES section: the test's own failing line (``>``,
    the first frame, which is the test) and the final error lines (``E``) down to the first level of
    pytest's "where" detail. Library frames are left out: they would show the planted line."""
    name = ".".join(test_id.split("::")[1:])
    area = _failures_area(log)
    heads = list(_SECTION.finditer(area))
    for i, head in enumerate(heads):
        if head.group(1) != name:
            continue
        body = area[head.end() : heads[i + 1].start() if i + 1 < len(heads) else len(area)].splitlines()
        arrow = next((line for line in body if line.startswith(">")), "")
        blocks: list[list[str]] = [[]]
        for line in body:  # the last block of E lines is the error that ended the test
            if line.startswith("E ") or line == "E":
                blocks[-1].append(line)
            elif blocks[-1]:
                blocks.append([])
        last = [
            line for line in next((b for b in reversed(blocks) if b), []) if not _NESTED_WHERE.match(line)
        ]
        lines = ([arrow] if arrow else []) + last[:max_lines]
        return _ADDRESS.sub(" at 0x...", "\n".join(line[:width] for line in lines))
    return ""
