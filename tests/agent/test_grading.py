"""Grading the field's way: the agent's diff, the filter, and a real tiny task graded in the jail.

The tiny task is a one-file library with a planted bug (``calc.clamp`` returns the value above the
range), a visible test (PASS_TO_PASS) and a hidden test file added by the test patch (FAIL_TO_PASS
and PASS_TO_PASS). Its independent references: the gold edit scores 1 and the empty episode 0.
Every forging attempt scores 0 through the public API; where the attempt is live, a naive grader
(the episode's own tree, test patch applied over it, tests run, swebench reading the log) is shown
to be fooled by it, so each test could fail.
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from areal_npu.agent.diffs import split_diff
from areal_npu.agent.grading import (
    GRADING_ENV,
    agent_diff,
    command_scripts,
    evaluate_log,
    filter_diff,
    grade,
    grade_r2e,
    is_protected,
)
from areal_npu.agent.jail import JailLimits, Mount, backend, interpreter
from areal_npu.agent.repo_task import CommandTests, RepoTask
from areal_npu.agent.tasksets import from_row

DATA = Path(__file__).parent / "data"
JAIL_OK, JAIL_WHY = backend("bwrap").available()
needs_jail = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
GIT_ENV = {
    "PATH": "/usr/bin:/bin",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "HOME": "/tmp",
}

CALC = '''"""Small numeric helpers."""


def clamp(value, low, high):
    """value limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return value
    return value


def mean(values):
    """Arithmetic mean of a non-empty list."""
    return sum(values) / len(values)
'''
GOLD = CALC.replace("    if value > high:\n        return value", "    if value > high:\n        return high")
VISIBLE = "from calc import mean\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n"
HIDDEN = (
    "from calc import clamp\n\n\ndef test_clamp_high():\n    assert clamp(15, 0, 10) == 10\n\n\n"
    "def test_clamp_inside():\n    assert clamp(5, 0, 10) == 5\n"
)
TEST_PATCH = (
    "diff --git a/tests/test_hidden.py b/tests/test_hidden.py\nnew file mode 100644\n--- /dev/null\n"
    f"+++ b/tests/test_hidden.py\n@@ -0,0 +1,{HIDDEN.count(chr(10))} @@\n"
    + "".join(f"+{line}\n" for line in HIDDEN.splitlines())
)
PYTEST = ".venv/bin/python -m pytest -rA -p no:cacheprovider -p no:hypothesispytest -p no:benchmark"
F2P = ("tests/test_hidden.py::test_clamp_high",)
P2P = ("tests/test_hidden.py::test_clamp_inside", "tests/test_visible.py::test_mean")
TASK = RepoTask("calc-1", "clamp(15, 0, 10) returns 15", None, CommandTests(
    command=f"{PYTEST} tests/test_hidden.py tests/test_visible.py", patch=TEST_PATCH, fail_to_pass=F2P,
    pass_to_pass=P2P))  # fmt: skip
SITE = f".venv/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
LIMITS = JailLimits(wall_seconds=60, cpu_seconds=60, output_bytes=1 << 20)


class Link(str):
    """An edit that makes the path a symlink to this target."""


def jail_run(workdir="/repo"):
    def run(command, repo):
        res = backend("bwrap").run(["/bin/sh", "-c", command], [Mount(repo, workdir, True)], LIMITS, cwd=workdir,
                                   env=dict(GRADING_ENV))  # fmt: skip
        return (
            res.output.decode("utf-8", "replace"),
            res.exit_code,
            {"timed_out": res.timed_out, "error": res.error},
        )

    return run


def write_tree(root: Path, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        if content is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Link):
            path.symlink_to(str(content))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grading") / "base"
    root.mkdir()
    write_tree(root, {"calc.py": CALC, "tests/test_visible.py": VISIBLE, "README.md": "# calc\n"})
    subprocess.run([interpreter(), "-m", "venv", "--without-pip", "--system-site-packages", str(root / ".venv")],
                   check=True)  # fmt: skip
    return root


@pytest.fixture
def episode(base, tmp_path):
    def make(edits: dict | None = None) -> Path:
        copy = tmp_path / "episode"
        shutil.copytree(base, copy, symlinks=True)
        write_tree(copy, edits or {})
        return copy

    return make


def naive_reward(episode_dir: Path, tmp: Path) -> float:
    """What a grader that trusts the episode's tree would say: the test patch applied over it (ignoring
    a failure), the task's command run there, swebench reading the log."""
    copy = tmp / "naive"
    shutil.copytree(episode_dir, copy, symlinks=True)
    subprocess.run(
        ["git", "apply", "-"], cwd=copy, input=TEST_PATCH.encode(), env=GIT_ENV, capture_output=True
    )
    res = backend("bwrap").run(["/bin/sh", "-c", TASK.hidden_tests.command], [Mount(copy, "/repo", True)], LIMITS,
                               cwd="/repo")  # fmt: skip
    return evaluate_log(res.output.decode(), res.exit_code, TASK.hidden_tests)[0]


# -- the references ---------------------------------------------------------------------------------------------


@needs_jail
def test_gold_scores_1_and_empty_scores_0(base, episode, tmp_path):
    gold = grade(TASK, base, episode({"calc.py": GOLD}), jail_run())
    assert gold.reward == 1.0, gold.details
    assert gold.details["reason"] == "resolved"
    assert gold.details["f2p"]["passed"] == 1 and gold.details["p2p"]["passed"] == 2
    assert (gold.details["passed"], gold.details["total"]) == (3, 3)
    assert gold.details["dropped_paths"] == [] and gold.details["suspicious"] == []
    shutil.rmtree(tmp_path / "episode")
    empty = grade(TASK, base, episode(), jail_run())
    assert empty.reward == 0.0 and empty.details["reason"] == "unresolved"
    assert empty.details["f2p"] == {"passed": 0, "total": 1, "failed": list(F2P)}
    assert set(empty.details["seconds"]) == {"diff", "apply", "tests", "total"}


# -- forging attempts ----------------------------------------------------------------------------------------------

FORCE_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
SKIP_AS_PASS = """import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.skip(reason="later"))


def pytest_report_teststatus(report):
    if report.skipped:
        return "passed", ".", "PASSED"
"""
LOAD_PLUGIN = 'import os\nos.environ["PYTEST_PLUGINS"] = "forged_plugin"\n'
STUB_TESTS = "def test_clamp_high():\n    pass\n\n\ndef test_clamp_inside():\n    pass\n\n\ndef test_mean():\n    pass\n"
PATCH_THROUGH_TEST = VISIBLE + (
    "\n\nimport calc  # noqa\n\n\ndef _fixed(value, low, high):\n    return max(low, min(value, high))\n\n\n"
    "calc.clamp.__code__ = _fixed.__code__\n"
)
FAKE_PYTEST = "".join(f'print("PASSED {t}")\n' for t in F2P + P2P)


def claim_at_exit(then: str = "") -> str:
    """calc.py code that, when the interpreter ends (pytest's capture is over by then), prints a fake exit
    code marker and every test as passed, then runs ``then``."""
    body = "".join(f"    {line}\n" for line in ["print('>>>>> Test Exit Code: 0')", *FAKE_PYTEST.splitlines(),
                                                   "sys.stdout.flush()", *([then] if then else [])])  # fmt: skip
    return f"import atexit, os, sys\n\n\ndef _claim():\n{body}\n\natexit.register(_claim)\n\n\n"


PLUGIN = {"forged_plugin.py": FORCE_PASS}
FORGERIES = {  # name: (edits, live against the naive grader)
    "conftest_forces_passes": ({"conftest.py": FORCE_PASS}, True),
    "conftest_skip_as_pass": ({"tests/conftest.py": SKIP_AS_PASS}, True),
    "entry_point_egg_info": ({"forged.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: forged\nVersion: 1.0\n",
                              "forged.egg-info/entry_points.txt": "[pytest11]\nforged = forged_plugin\n", **PLUGIN},
                             True),
    "entry_point_dist_info": ({"forged-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: forged\nVersion: 1.0\n",
                               "forged-1.0.dist-info/entry_points.txt": "[pytest11]\nforged = forged_plugin\n",
                               **PLUGIN}, True),
    "sitecustomize": ({f"{SITE}/sitecustomize.py": LOAD_PLUGIN, **PLUGIN}, True),
    "usercustomize": ({f"{SITE}/usercustomize.py": LOAD_PLUGIN, **PLUGIN}, True),
    "pth_file": ({f"{SITE}/forged.pth": LOAD_PLUGIN.replace("\n", "; ", 1), **PLUGIN}, True),
    "pytest_ini_addopts_and_env_file": ({"pytest.ini": "[pytest]\naddopts = -p forged_plugin\n",
                                         ".env": "PYTHONPATH=.\nPYTEST_PLUGINS=forged_plugin\n", **PLUGIN}, True),
    "setup_cfg_addopts": ({"setup.cfg": "[tool:pytest]\naddopts = -p forged_plugin\n", **PLUGIN}, True),
    "pyproject_pythonpath": ({"pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["forged"]\n'
                                                'addopts = "-p forged_plugin"\n',
                              "forged/forged_plugin.py": FORCE_PASS}, True),
    "visible_test_patches_the_code": ({"tests/test_visible.py": PATCH_THROUGH_TEST}, True),
    "hidden_test_planted_ahead": ({"tests/test_hidden.py": STUB_TESTS}, True),
    "tests_deleted": ({"tests/test_visible.py": None}, False),
    "test_files_linked_to_agent_file": ({"agent_tests.py": STUB_TESTS, "tests/test_hidden.py": Link("../agent_tests.py"),
                                         "tests/test_visible.py": Link("../agent_tests.py")}, True),
    "tests_dir_linked_to_agent_dir": ({"fake/test_hidden.py": STUB_TESTS, "fake/test_visible.py": STUB_TESTS,
                                       "tests": Link("fake")}, True),
    "runner_shadowed": ({"pytest.py": FAKE_PYTEST}, True),
}  # fmt: skip


@needs_jail
@pytest.mark.parametrize("name", list(FORGERIES))
def test_forging_attempt_scores_0(name, base, episode, tmp_path):
    edits, live = FORGERIES[name]
    forged = episode(edits)
    with ThreadPoolExecutor(2) as pool:  # two jails side by side (one core each): half the wall time
        graded = pool.submit(grade, TASK, base, forged, jail_run())
        naive = pool.submit(naive_reward, forged, tmp_path) if live else None
        result = graded.result()
    assert result.reward == 0.0, result.details
    assert result.details["reason"] == "unresolved"  # the real tests ran and the bug is still there
    assert result.details["f2p"]["passed"] == 0
    # the attempt works on a grader that trusts the episode's tree: the defence is what stops it
    if naive is not None:
        assert naive.result() == 1.0


@needs_jail
def test_gold_with_every_forgery_still_scores_1(base, episode):
    """The filter drops the forgeries and keeps the fix (and the agent's other, harmless files)."""
    edits = {"calc.py": GOLD, "NOTES.md": "fixed clamp\n"}
    for name, (more, _) in FORGERIES.items():
        if name != "tests_dir_linked_to_agent_dir":  # a link where the others write files
            edits.update(more)
    result = grade(TASK, base, episode(edits), jail_run())
    assert result.reward == 1.0, result.details
    dropped = set(result.details["dropped_paths"])
    assert {"conftest.py", "tests/conftest.py", "forged.egg-info/entry_points.txt", f"{SITE}/sitecustomize.py",
            f"{SITE}/forged.pth", "pytest.ini", "setup.cfg", "pyproject.toml", "tests/test_visible.py",
            "tests/test_hidden.py"} <= dropped  # fmt: skip
    assert not {"calc.py", "NOTES.md", "forged_plugin.py", ".env"} & dropped


@needs_jail
def test_episode_output_is_no_input(base, episode):
    """Lines the episode printed (or left in a file) are never read: grading has no parameter for the
    episode's outputs, and a log file in the repository is just a file."""
    repo = episode()
    lines = "".join(f"PASSED {t}\n" for t in F2P + P2P)
    res = backend("bwrap").run(["/bin/sh", "-c", f"printf '{lines}' | tee test_output.txt"],
                               [Mount(repo, "/repo", True)], LIMITS, cwd="/repo")  # fmt: skip
    assert res.output.decode() == lines and (repo / "test_output.txt").read_text() == lines
    result = grade(TASK, base, repo, jail_run())
    assert result.reward == 0.0 and "test_output.txt" not in result.details["dropped_paths"]


@needs_jail
def test_printed_passes_with_a_failing_exit_code_score_0(base, episode, tmp_path):
    """Code under test prints every test as passed (after pytest's summary, so its lines win) and a fake
    exit-code marker, while pytest exits 1: swebench's exit-code cross-check rejects the log, and the
    fake marker cannot stand in for the real exit code."""
    result = grade(TASK, base, episode({"calc.py": claim_at_exit() + CALC}), jail_run())
    assert result.reward == 0.0 and result.details["reason"] == "log_invalid", result.details
    assert result.details["exit_code"] == 1
    # the same log framed the way an in-environment eval script frames it is accepted by swebench as is
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE
    from swebench.harness.grading import get_logs_eval
    from swebench.types import TestSpec

    (tmp_path / "log").write_text(f"{START_TEST_OUTPUT}\n{result.details['log_tail']}\n{END_TEST_OUTPUT}\n"
                                  f"{TEST_EXIT_CODE}: 1\n")  # fmt: skip
    spec = TestSpec("x", "", [], "", "", list(F2P), list(P2P), log_parser="parse_log_pytest")
    statuses, found = get_logs_eval(spec, str(tmp_path / "log"))
    assert found and set(statuses.values()) == {"PASSED"}


@needs_jail
def test_known_limit_code_under_test_shares_the_runner_process(base, episode):
    """The documented limit (module docstring): code under test that prints the runner's lines at exit and
    exits 0 is graded as resolved, as SWE-bench and R2E-Gym would. If this ever fails, update the
    docstring: the limit was closed."""
    result = grade(TASK, base, episode({"calc.py": claim_at_exit("os._exit(0)") + CALC}), jail_run())
    assert result.reward == 1.0
    # ... but flagged (agent/suspicious.py): the exit hook, the hard exit and the printed runner lines
    kinds = {line.split(": ")[1] for line in result.details["suspicious"]}
    assert kinds == {"exit_hook", "hard_exit", "runner_output"}


@needs_jail
def test_patch_that_cannot_apply_is_patch_failed(base, tmp_path):
    """The agent turned a directory into a file, but a protected file inside it stays: the kept diff adds
    a file where the grading copy still has a directory."""
    base_with_pkg = tmp_path / "base"
    shutil.copytree(base, base_with_pkg, symlinks=True)
    write_tree(base_with_pkg, {"pkg/conftest.py": "", "pkg/mod.py": "x = 1\n"})
    ep = tmp_path / "ep"
    shutil.copytree(base_with_pkg, ep, symlinks=True)
    write_tree(ep, {"pkg": "not a directory any more\n"})
    result = grade(TASK, base_with_pkg, ep, jail_run())
    assert result.reward == 0.0 and result.details["reason"] == "patch_failed", result.details
    assert "pkg" in result.details["apply_error"] and result.details["dropped_paths"] == ["pkg/conftest.py"]


def test_task_errors_raise_before_anything_runs(base, episode):
    def never(command, repo):
        raise AssertionError("ran")

    bad = RepoTask("t", "", None, CommandTests("true", patch="--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n",
                                                 fail_to_pass=F2P))  # fmt: skip
    with pytest.raises(ValueError, match="git-format"):
        grade(bad, base, episode(), never)
    with pytest.raises(ValueError, match="log_parser 'nosuch'"):
        grade(
            RepoTask("t", "", None, CommandTests("true", fail_to_pass=F2P, log_parser="nosuch")),
            base,
            base,
            never,
        )
    with pytest.raises(ValueError, match="both empty"):
        grade(RepoTask("t", "", None, CommandTests("true")), base, base, never)


# -- R2E-Gym ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def r2e(base):
    row = json.loads((DATA / "r2e_gym_row.json").read_text())
    task = from_row(row, base.parent)  # R2E-Gym rows carry no instance_id: the loader derives one
    execution = json.loads(row["execution_result_content"])
    image_tree = base.parent / "r2e-base"  # what the image ships at /testbed: the hidden tests and runner too
    if not image_tree.exists():
        shutil.copytree(base, image_tree, symlinks=True)
        files = {
            f"r2e_tests/{n}": c for n, c in zip(execution["test_file_names"], execution["test_file_codes"])
        }
        write_tree(
            image_tree, {**files, "run_tests.sh": f"{PYTEST.replace(' -m', ' -W ignore -m')} r2e_tests\n"}
        )
    return task, image_tree, execution


def test_r2e_recorded_logs_grade_as_recorded(r2e):
    """The row's own recorded runs: the fixed commit's output equals expected_output_json, the old one not."""
    task, _, execution = r2e
    tests = task.hidden_tests
    assert tests.expected_statuses["test_mean_of_empty_list"] == "FAILED"
    assert evaluate_log(execution["new_commit_res_stdout"], execution["new_commit_res_code"], tests)[0] == 1.0
    reward, details = evaluate_log(
        execution["old_commit_res_stdout"], execution["old_commit_res_code"], tests
    )
    assert reward == 0.0 and details["mismatched"] == ["TestClamp.test_above_range"]


@needs_jail
def test_r2e_gold_1_empty_0_forged_0(r2e, tmp_path):
    task, image_tree, _ = r2e
    run = jail_run("/testbed")

    def agent_copy(name, edits):  # the agent's copy lacks the hidden paths; the grading base has them
        copy = tmp_path / name
        shutil.copytree(image_tree, copy, symlinks=True)
        write_tree(copy, {"run_tests.sh": None, "r2e_tests": None, **edits})
        return copy

    gold = grade_r2e(task, image_tree, agent_copy("gold", {"calc.py": GOLD}), run)
    assert gold.reward == 1.0, gold.details
    # the agent's copy lacks the hidden paths: the diff deletes them, the filter drops the deletions
    assert gold.details["matched"] == 4
    assert gold.details["dropped_paths"] == ["r2e_tests/test_1.py", "run_tests.sh"]
    assert grade_r2e(task, image_tree, agent_copy("empty", {}), run).reward == 0.0
    planted = {"conftest.py": FORCE_PASS, "r2e_tests/test_1.py": STUB_TESTS, "run_tests.sh": "echo PASSED\n"}
    forged = grade_r2e(task, image_tree, agent_copy("forged", planted), run)
    assert forged.reward == 0.0 and {"conftest.py", "r2e_tests/test_1.py", "run_tests.sh"} <= set(
        forged.details["dropped_paths"]
    )
    with pytest.raises(ValueError, match="not an R2E-Gym task"):
        grade_r2e(TASK, image_tree, image_tree, run)


# -- the diff -------------------------------------------------------------------------------------------------------


def manifest(root: Path) -> dict:
    """Every entry under root (``.git`` and FIFOs left out): kind, mode bits and content or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git" and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames + [d for d in os.listdir(dirpath) if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_file():
                out[rel] = ("file", os.access(path, os.X_OK), path.read_bytes())
    return out


def test_agent_diff_round_trips_every_kind_of_change(tmp_path):
    """Binary, non-UTF-8, CRLF, mode, symlink, deletion, new directories, quoted names: stock ``git
    apply`` of the diff onto a copy of the base gives the episode's tree; a planted .gitattributes,
    .gitignore and the episode's own .git change nothing."""
    base, ep = tmp_path / "base", tmp_path / "ep"
    base.mkdir()
    write_tree(base, {"bin.dat": bytes(range(256)) * 4, "latin.py": "x = 'caf\xe9'\n".encode("latin-1"),
                      "crlf.py": b"a\r\nb\r\n", "run.sh": "echo hi\n", "link": Link("bin.dat"), "gone.txt": "bye\n",
                      "t\xe9st dir/a b.py": "v = 1\n"})  # fmt: skip
    shutil.copytree(base, ep, symlinks=True)
    write_tree(ep, {"bin.dat": bytes(range(255, -1, -1)) * 4, "latin.py": "x = 'na\xefve'\n".encode("latin-1"),
                    "crlf.py": b"a\r\nc\r\n", "link": Link("/etc/passwd"), "gone.txt": None, "new/deep/m.py": "m = 2\n",
                    "t\xe9st dir/a b.py": "v = 2\n", ".gitignore": "*\n",
                    ".gitattributes": "* text eol=crlf filter=evil\n*.py -diff\n[attr]opaque -diff -text\n* opaque\n",
                    ".git/info/exclude": "*\n", ".git/config": "[core]\n\texcludesFile = /etc/passwd\n"})  # fmt: skip
    os.chmod(ep / "run.sh", 0o755)
    os.mkfifo(ep / "pipe")
    diff = agent_diff(base, ep)
    assert "+c\r" in diff and "GIT binary patch" in diff  # .py stays text despite '-diff'; CRLF kept
    assert not any(p.startswith(".git/") for c in split_diff(diff) for p in c.paths)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy, symlinks=True)
    res = subprocess.run(["git", "apply", "-"], cwd=copy, input=diff.encode("utf-8", "surrogateescape"), env=GIT_ENV,
                         capture_output=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert manifest(copy) == {k: v for k, v in manifest(ep).items() if k != "pipe"}


def test_nested_repository_is_a_dropped_gitlink(tmp_path):
    base, ep = tmp_path / "base", tmp_path / "ep"
    write_tree(base, {"a.py": "a = 1\n"})
    shutil.copytree(base, ep)
    write_tree(ep, {"sub/x.py": "x = 1\n", "a.py": "a = 2\n"})
    subprocess.run(["git", "init", "-q", str(ep / "sub")], check=True, env=GIT_ENV)
    subprocess.run(["git", "-c", "user.name=n", "-c", "user.email=e@x", "commit", "-q", "--allow-empty", "-m", "m"],
                   cwd=ep / "sub", check=True, env=GIT_ENV)  # fmt: skip
    kept, dropped = filter_diff(agent_diff(base, ep))
    assert dropped == ["sub"] and [c.paths for c in split_diff(kept)] == [("a.py",)]


# -- the filter -----------------------------------------------------------------------------------------------------


def section(header: str, body: str = "") -> str:
    return f"diff --git {header}\n{body}"


KEPT = [
    section("a/src/lib.py b/src/lib.py", "index 1111111..2222222 100644\n--- a/src/lib.py\n+++ b/src/lib.py\n"
            "@@ -1 +1 @@\n-x = 1\n+x = 2\n"),
    section("a/src/b.py b/src/b.py", "--- a/src/b.py\n+++ b/src/b.py\n@@ -1,2 +1 @@\n--- a/tests/test_x.py\n"
            " keep\n"),  # a removed line that looks like a header
    section("a/docs/link b/docs/link", "new file mode 120000\nindex 0000000..3333333\n--- /dev/null\n"
            "+++ b/docs/link\n@@ -0,0 +1 @@\n+../README\n\\ No newline at end of file\n"),
    section("a/my dir/x.py b/your dir/x.py", "similarity index 100%\nrename from my dir/x.py\nrename to your dir/x.py\n"),
]  # fmt: skip
DROPPED = [
    section("a/tests/test_lib.py b/tests/test_lib.py", "--- a/tests/test_lib.py\n+++ b/tests/test_lib.py\n"
            "@@ -1 +1 @@\n-assert f()\n+pass\n"),
    section("a/src/a.py b/pkg/tests/a.py", "similarity index 100%\nrename from src/a.py\nrename to pkg/tests/a.py\n"),
    section("a/conftest.py b/conftest.py", "deleted file mode 100644\nindex 4444444..0000000\n--- a/conftest.py\n"
            "+++ /dev/null\n@@ -1 +0,0 @@\n-import pytest\n"),
    section("a/pkg/__pycache__/m.cpython-311.pyc b/pkg/__pycache__/m.cpython-311.pyc",
            "new file mode 100644\nindex 0000000..5555555\nGIT binary patch\nliteral 3\nKcmZ>Y%>w`c2mk;8\n\nliteral 0\n"
            "HcmV?d00001\n\n"),
    section("a/setup.cfg b/setup.cfg", "old mode 100644\nnew mode 100755\n"),
    section('"a/t\\303\\251st dir/test_\\303\\251.py" "b/t\\303\\251st dir/test_\\303\\251.py"',
            'new file mode 100644\nindex 0000000..6666666\n--- /dev/null\n+++ "b/t\\303\\251st dir/test_\\303\\251.py"\n'
            "@@ -0,0 +1 @@\n+x = 1\n"),
    section("a/vendor/lib b/vendor/lib", "new file mode 160000\nindex 0000000..7777777\n--- /dev/null\n"
            "+++ b/vendor/lib\n@@ -0,0 +1 @@\n+Subproject commit 7777777\n"),
    section("a/src/extra.py b/src/extra.py", "new file mode 100644\n--- /dev/null\n+++ b/src/extra.py\n"
            "@@ -0,0 +1 @@\n+y = 1\n"),  # protected by the caller (the test patch touches it)
]  # fmt: skip


def test_filter_diff_drops_whole_sections_by_path():
    diff = "".join(s for pair in zip(KEPT, DROPPED) for s in pair) + "".join(DROPPED[len(KEPT) :])
    kept, dropped = filter_diff(diff, ["src/extra.py"])
    assert kept == "".join(KEPT)
    assert dropped == sorted(["tests/test_lib.py", "src/a.py", "pkg/tests/a.py", "conftest.py", "setup.cfg",
                              "pkg/__pycache__/m.cpython-311.pyc", "t\xe9st dir/test_\xe9.py", "vendor/lib",
                              "src/extra.py"])  # fmt: skip
    assert [c.paths for c in split_diff(kept)][-1] == ("my dir/x.py", "your dir/x.py")
    assert filter_diff("", []) == ("", [])
    with pytest.raises(ValueError, match="git-format"):
        filter_diff("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n", [])


@pytest.mark.parametrize(
    ("path", "protected"),
    [("src/calc.py", False), ("tests/helpers.py", True), ("pkg/test/data.json", True), ("test_calc.py", True),
     ("pkg/calc_test.py", True), ("pkg/testing.py", False), ("src/conftest.py", True), ("sitecustomize.py", True),
     ("lib/usercustomize.py", True), ("x.pth", True), ("foo-1.0.dist-info/entry_points.txt", True),
     ("foo.egg-info", True), ("pytest.ini", True), ("tox.ini", True), ("setup.cfg", True), ("pyproject.toml", True),
     ("pkg/__pycache__/m.cpython-311.pyc", True), ("m.pyc", True), (".venv/bin/python", True),
     ("pytest.py", True), ("_pytest/main.py", True), ("src/pytest_helpers.py", False), ("docs/pytest.md", False),
     ("attest.py", False), ("contest.py", False)],
)  # fmt: skip
def test_is_protected(path, protected):
    assert is_protected(path) is protected


def test_command_scripts_are_what_the_command_runs(tmp_path):
    """A runner script the command executes is protected (the agent must not rewrite it); a module the
    command names as a test target is not (the agent may have to fix it)."""
    write_tree(tmp_path, {"bin/test": "", "run_tests.sh": "", "runtests.py": "", "calc.py": ""})
    os.chmod(tmp_path / "bin/test", 0o755)
    assert command_scripts("bash -e run_tests.sh", tmp_path) == ["run_tests.sh"]
    assert command_scripts("cd . && ./bin/test -C sympy/core", tmp_path) == ["bin/test"]
    assert command_scripts("timeout 30 python3 -W ignore runtests.py;echo done", tmp_path) == ["runtests.py"]
    assert command_scripts("python -m pytest --doctest-modules calc.py", tmp_path) == []
    assert command_scripts("python -c 'import calc' calc.py", tmp_path) == []


@needs_jail
def test_a_symlinked_test_dir_never_makes_grading_write_on_the_host(base, episode, tmp_path):
    # the agent points the test directory at a host folder; restoring the hidden tests must not write there
    host = tmp_path / "host"
    host.mkdir()
    (host / "keep.txt").write_text("host file")
    result = grade(TASK, base, episode({"tests": Link(str(host))}), jail_run())
    assert result.reward == 0.0 and sorted(p.name for p in host.iterdir()) == ["keep.txt"]
    assert (host / "keep.txt").read_text() == "host file"
