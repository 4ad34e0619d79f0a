"""Builds a task set from its pinned description, the way SWE-smith makes tasks.

For each library: fetch and unpack its sdist, run its suite three times (a test is a baseline passer
when it passed every time), then try planted bugs in seeded order. A bug is kept when some baseline
passers now fail and all of them are in the suite's test files (:func:`suite.split_tests`); at most
one bug per function. A kept bug becomes one SWE-bench row:

- ``patch`` (gold) reverts the bug; ``test_patch`` adds back the test files holding the failing
  tests, which the snapshot the agent gets lacks; both are ``git diff`` output (a/ b/ prefixes);
- ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` are JSON strings of pytest ids, as in SWE-bench;
- ``snapshot`` is the buggy tree without the hidden files (``snapshots/<instance_id>/``).

Then every row is checked the way it will be graded: on a copy of the snapshot, test patch alone ->
every FAIL_TO_PASS test fails and PASS_TO_PASS passes; test patch + gold -> all pass. A row that
fails the check is dropped (counted in the report).

The output folder is written in a temporary sibling and renamed into place, so a reader never sees
half a set; the cached default is ``$AREAL_NPU_CACHE/tasksets/<name>-<hash>`` and is reused while
``build.json`` records the same description hash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TextColumn

from areal_npu.agent.fs import remove_tree
from areal_npu.agent.rootfs import cache_root
from areal_npu.agent.taskgen import mutations, sdist, suite
from areal_npu.agent.taskgen.spec import GENERATOR_VERSION, LibrarySpec, TaskSetSpec
from areal_npu.agent.taskgen.statement import problem_statement

BASELINE_RUNS = 3
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree: a diff from it adds files
_GIT = ["git", "-c", "user.name=taskgen", "-c", "user.email=taskgen@localhost", "-c", "core.autocrlf=false",
        "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "-c", "commit.gpgsign=false"]  # fmt: skip
_DIFF = ["diff", "--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/"]


@dataclass
class LibraryReport:
    library: str  # name==version
    tests: int = 0  # baseline passers
    suite_s: float = 0.0  # one baseline run
    tried: int = 0  # mutations run
    kept: int = 0
    dropped_by_check: int = 0
    fail_to_pass_mean: float = 0.0
    seconds: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class BuildResult:
    path: Path  # the folder holding tasks.jsonl
    reused: bool
    reports: list[LibraryReport]


def git(repo: Path, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run([*_GIT, *args], cwd=repo, input=stdin, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.strip()[-800:]}")
    return proc.stdout


def _git_repo(source: Path, dest: Path) -> Path:
    """A copy of ``source`` committed as one git commit: the reference every diff is taken against."""
    shutil.copytree(source, dest, symlinks=True)
    git(dest, "init", "-q")
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "--no-verify", "-m", "sdist")
    return dest


def gold_patch(repo: Path, rel: str, buggy: str, fixed: str) -> str:
    """``git diff`` from ``buggy`` to ``fixed`` for the file ``rel`` of the git repository ``repo`` (the
    buggy text staged, the fixed one in the work tree); leaves the index and the file as committed."""
    committed = (repo / rel).read_bytes()
    try:
        (repo / rel).write_text(buggy)
        git(repo, "add", "--", rel)
        (repo / rel).write_text(fixed)
        return git(repo, *_DIFF, "--", rel)
    finally:
        git(repo, "reset", "-q", "--", rel)
        (repo / rel).write_bytes(committed)


def added_files_patch(repo: Path, files: list[str]) -> str:
    """``git diff`` that adds ``files`` as committed in ``repo`` (a diff from git's empty tree)."""
    return git(repo, *_DIFF, EMPTY_TREE, "HEAD", "--", *files)


def _seed(spec: TaskSetSpec, text: str) -> int:
    return spec.seed * 1_000_003 + zlib.crc32(text.encode())


def _baseline(runner: suite.Runner, repo: Path, lib: LibrarySpec, timeout: float) -> tuple[set[str], float]:
    """Baseline passers: passed in each of ``BASELINE_RUNS`` runs, under the same id (a flaky test would
    make a flaky task; a parametrized id built from a set's order or an object's address changes from
    run to run where the interpreter randomizes addresses)."""
    runs, seconds = [], 0.0
    for _ in range(BASELINE_RUNS):
        start = time.monotonic()
        log, _code = runner(repo, lib.test_command, timeout=timeout)
        seconds = time.monotonic() - start
        runs.append({t for t, s in suite.parse_statuses(log).items() if s == "PASSED"})
    passers = set.intersection(*runs)
    strays = sorted(t for t in passers if not (repo / suite.test_file(t)).is_file())
    if strays:  # ids relative to another rootdir would never match the hidden files
        raise RuntimeError(f"{lib.name}: test id {strays[0]!r} names no file under the sdist's top folder; "
                           "give the test command a rootdir there (e.g. --rootdir=.)")  # fmt: skip
    if not passers:
        raise RuntimeError(f"{lib.name}=={lib.version}: no test passed at baseline with {lib.test_command!r}:\n"
                           f"{log[-3000:]}")  # fmt: skip
    return passers, seconds


def _run_mutation(runner, repo: Path, lib: LibrarySpec, m: mutations.Mutation, original: str, timeout: float):
    path = repo / m.file
    path.write_text(mutations.apply(original, m))
    try:
        log, code = runner(repo, lib.test_command, timeout=timeout)
    finally:
        path.write_text(original)
    return suite.parse_statuses(log), log, code


def _row(lib: LibrarySpec, spec: TaskSetSpec, repo: Path, iid: str, m: mutations.Mutation, original: str,
         f2p: list[str], p2p: list[str], snapshots: Path, runner: suite.Runner, timeout: float
         ) -> dict:  # fmt: skip
    """The SWE-bench row of one kept bug, and its snapshot written under ``snapshots``."""
    hidden = sorted({suite.test_file(t) for t in f2p})
    hidden_set = {str(repo / h) for h in hidden}
    buggy = mutations.apply(original, m)
    (repo / m.file).write_text(buggy)
    try:
        shutil.copytree(repo, snapshots / iid, symlinks=True,
                        ignore=lambda d, names: [n for n in names if n == ".git" and Path(d) == repo
                                                 or os.path.join(d, n) in hidden_set])  # fmt: skip
        # the statement's excerpts come from a run with a fixed hash seed: a set's order in an assertion
        # message would otherwise differ from build to build (the filtering runs keep random seeds)
        log, _code = runner(repo, f"export PYTHONHASHSEED=0; {lib.test_command}", timeout=timeout)
    finally:
        (repo / m.file).write_text(original)
    gold = gold_patch(repo, m.file, buggy, original)
    test_patch = added_files_patch(repo, hidden)
    excerpts = {t: suite.failure_excerpt(log, t) for t in f2p[:2]}
    listed_p2p = suite.cap_pass_to_pass(p2p, set(hidden), spec.max_pass_to_pass, _seed(spec, iid))
    return {
        "instance_id": iid,
        "repo": lib.repo,
        "base_commit": lib.sha256[:40],
        "version": lib.version,
        "problem_statement": problem_statement(m, lib.name, lib.version, f2p, excerpts, _seed(spec, iid)),
        "hints_text": "",
        "patch": gold,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(listed_p2p),
        "test_command": lib.test_command,
        "image": spec.image,
        "log_parser": suite.LOG_PARSER,
        "eval_type": "pass_and_fail",
        "snapshot": f"snapshots/{iid}",
        "library": f"{lib.name}=={lib.version}",
        "sdist_sha256": lib.sha256,
        "mutation": {
            "file": m.file,
            "function": m.qualname,
            "line": m.line,
            "kind": m.kind,
            "description": m.description,
        },  # fmt: skip
    }


def check_row(row: dict, snapshot: Path, runner: suite.Runner, timeout: float) -> str:
    """Grades the row's own patches on a copy of its snapshot: '' when test patch alone fails every
    FAIL_TO_PASS test (and passes PASS_TO_PASS) and test patch + gold passes all; else why not."""
    f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
    with tempfile.TemporaryDirectory(prefix="taskgen-check-") as tmp:
        repo = Path(tmp) / "repo"
        shutil.copytree(snapshot, repo, symlinks=True)
        for name in ("test_patch", "patch"):
            try:
                git(repo, "apply", "--whitespace=nowarn", "-", stdin=row[name])
            except RuntimeError as exc:
                return f"{name} does not apply: {exc}"
            statuses = suite.parse_statuses(runner(repo, row["test_command"], timeout=timeout)[0])
            passed = {t for t, s in statuses.items() if s == "PASSED"}
            if name == "test_patch" and (set(f2p) & passed or set(p2p) - passed):
                return "without the fix: a FAIL_TO_PASS test passes or a PASS_TO_PASS test fails"
            if name == "patch" and set(f2p + p2p) - passed:
                return f"with the fix: {sorted(set(f2p + p2p) - passed)[:3]} do not pass"
    return ""


def build_library(lib: LibrarySpec, spec: TaskSetSpec, runner: suite.Runner, work: Path, out: Path,
                  max_tasks: int, workers: int = 1, progress: bool = True, check: bool = True
                  ) -> tuple[list[dict], LibraryReport]:  # fmt: skip
    """The rows of one library (snapshots go to ``out/snapshots``); ``work`` is scratch space."""
    report, start = LibraryReport(f"{lib.name}=={lib.version}"), time.monotonic()
    archive = sdist.fetch(lib, cache_root() / "sdists")
    top = sdist.extract(archive, work / "sdist")
    for rel in lib.source_files:
        if not (top / rel).is_file():
            raise ValueError(f"{archive}: no file {rel} (libraries[{lib.name}].source_files)")
    repos = [_git_repo(top, work / f"repo{i}") for i in range(max(1, workers))]
    baseline, report.suite_s = _baseline(runner, repos[0], lib, spec.timeout_s)
    report.tests = len(baseline)
    timeout = min(spec.timeout_s, max(30.0, 10 * report.suite_s))
    originals = {rel: (top / rel).read_text() for rel in lib.source_files}
    found = [m for rel in lib.source_files for m in mutations.candidates(originals[rel], rel)]
    queue = mutations.order(found, _seed(spec, lib.slug))
    rows: list[dict] = []
    done_functions: set[tuple[str, str]] = set()
    bar = Progress(*Progress.get_default_columns(), TextColumn("{task.fields[kept]} kept"), disable=not progress,
                   console=Console(stderr=True))  # fmt: skip
    bar.start()
    line = bar.add_task(lib.name, total=min(spec.max_candidates, len(queue)), kept=0)
    with ThreadPoolExecutor(max_workers=len(repos)) as pool:
        while queue and len(rows) < max_tasks and report.tried < spec.max_candidates:
            batch: list[mutations.Mutation] = []
            while queue and len(batch) < len(repos) and report.tried + len(batch) < spec.max_candidates:
                m = queue.pop(0)
                if (m.file, mutations_function(m)) not in done_functions:
                    batch.append(m)
            results = list(pool.map(lambda pair: _run_mutation(runner, pair[0], lib, pair[1], originals[pair[1].file],
                                                               timeout), zip(repos, batch)))  # fmt: skip
            report.tried += len(batch)
            bar.advance(line, len(batch))
            for m, (statuses, _log, code) in zip(batch, results, strict=True):
                key = (m.file, mutations_function(m))
                f2p, p2p, why = suite.split_tests(baseline, statuses, lib.test_paths, spec.max_fail_to_pass)
                if code == suite.TIMEOUT_EXIT:  # a loop that never ends: its tests are missing, not failing
                    why = "the suite timed out"
                if not why and key in done_functions:
                    why = "function already has a task"
                if not why and any(not (top / suite.test_file(t)).is_file() for t in f2p):
                    why = "a failing test id names no file"
                if not why and len(rows) >= max_tasks:
                    why = "enough tasks"
                if why:
                    report.rejected[why] = report.rejected.get(why, 0) + 1
                    continue
                iid = f"{lib.slug}__{lib.slug}-{len(rows):04d}"
                row = _row(lib, spec, repos[0], iid, m, originals[m.file], f2p, p2p, out / "snapshots", runner,
                           timeout)  # fmt: skip
                why = check_row(row, out / "snapshots" / iid, runner, timeout) if check else ""
                if why:
                    report.dropped_by_check += 1
                    report.rejected["failed the check"] = report.rejected.get("failed the check", 0) + 1
                    print(f"{iid} ({m.description}) dropped: {why}", file=sys.stderr)
                    remove_tree(out / "snapshots" / iid)
                    continue
                rows.append(row)
                done_functions.add(key)
                bar.update(line, kept=len(rows))
    bar.stop()
    report.kept = len(rows)
    report.fail_to_pass_mean = sum(len(json.loads(r["FAIL_TO_PASS"])) for r in rows) / max(1, len(rows))
    report.seconds = time.monotonic() - start
    return rows, report


def mutations_function(m: mutations.Mutation) -> str:
    """The function a task is about: a nested def counts as its enclosing function."""
    return m.qualname.split(".<locals>.")[0]


def default_out(spec: TaskSetSpec, max_per_lib: int | None = None) -> Path:
    key = spec.key if max_per_lib is None else f"{spec.key}-max{max_per_lib}"
    return cache_root() / "tasksets" / key


def default_runner(rootfs: Path | None = None) -> suite.Runner:
    """The jail on the task set's environment root filesystem when there is one (the tests then run
    where they are graded), else this machine's interpreter."""
    return suite.jail_runner(rootfs) if rootfs is not None else suite.host_runner()


def build_taskset(spec: TaskSetSpec, out: Path | None = None, runner: suite.Runner | None = None,
                  rootfs: Path | None = None, force: bool = False, max_per_lib: int | None = None,
                  workers: int | None = None, progress: bool = True, check: bool = True) -> BuildResult:  # fmt: skip
    """Builds (or reuses) the set at ``out`` (default: the cache); see the module docstring."""
    out = Path(out) if out is not None else default_out(spec, max_per_lib)
    meta_path = out / "build.json"
    if not force and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("digest") == spec.digest and meta.get("max_per_lib") == max_per_lib:
            return BuildResult(out, True, [LibraryReport(**r) for r in meta["libraries"]])
    runner = runner or default_runner(rootfs)
    workers = workers or min(4, os.cpu_count() or 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        (tmp / "set" / "snapshots").mkdir(parents=True)
        rows, reports = [], []
        for lib in spec.libraries:
            lib_rows, report = build_library(lib, spec, runner, tmp / "work" / lib.slug, tmp / "set",
                                             max_per_lib or lib.tasks, workers, progress, check)  # fmt: skip
            rows += lib_rows
            reports.append(report)
            remove_tree(tmp / "work" / lib.slug)
        (tmp / "set" / "tasks.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        meta = {"name": spec.name, "digest": spec.digest, "generator": GENERATOR_VERSION, "max_per_lib": max_per_lib,
                "image": spec.image, "rootfs": str(rootfs) if rootfs else None, "tasks": len(rows),
                "libraries": [asdict(r) for r in reports]}  # fmt: skip
        (tmp / "set" / "build.json").write_text(json.dumps(meta, indent=1) + "\n")
        if out.exists():
            os.rename(out, tmp / "old")
        os.rename(tmp / "set", out)
    finally:
        remove_tree(tmp)
    return BuildResult(out, False, reports)
