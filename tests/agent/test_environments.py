"""The repository environment: reset / run / grade / close, the on-disk task-set loader and the
embedded repo-repair tasks. Expectations are hand-computed or observed on the host filesystem."""

import difflib
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from areal_npu.agent import fs
from areal_npu.agent.environments import EnvLimits, RepoEnv, materialize
from areal_npu.agent.jail import JailLimits, backend
from areal_npu.agent.repo_task import CallTest, RepoTask
from areal_npu.agent.repo_tasks import BUG_FAMILIES, make_repo_tasks
from areal_npu.agent.tasksets import load_jsonl
from tests.support.unittest_task import TEST_PATCH, unittest_id

JAIL_OK, JAIL_WHY = backend("bwrap").available()
needs_jail = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")

CALC = {"calc.py": "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n"}
CALL_TESTS = (
    CallTest("calc", "add", [2, 3], 5),
    CallTest("calc", "add", [0, 0], 0),
    CallTest("calc", "neg", [4], -4),
)


@needs_jail
def test_run_grade_close_on_a_call_tested_task():
    env = RepoEnv(RepoTask("calc", "add() subtracts", CALC, CALL_TESTS))
    assert env.reset() == "add() subtracts"
    assert env.run("python3 -c 'import calc; print(calc.add(2, 3))'") == ("-1\n", 0)
    assert env.run("exit 3") == ("", 3)
    low = env.grade()
    assert low.reward == 0.0 and (low.details["passed"], low.details["total"]) == (2, 3)  # add(0,0) is right
    out, code = env.run("sed -i 's/a - b/a + b/' calc.py && cat calc.py")
    assert code == 0 and "return a + b" in out
    assert (env.repo / "calc.py").read_text().count("a + b") == 1  # the host copy is the episode's repo
    high = env.grade()
    assert high.reward == 1.0 and high.details["reason"] == "ok"
    root = env.root
    env.close()
    assert not root.exists()


@needs_jail
def test_long_output_is_truncated_with_a_note():
    limits = EnvLimits(command=JailLimits(output_bytes=1000))
    with RepoEnv(RepoTask("t", "t", CALC, CALL_TESTS), limits) as env:
        out, code = env.run("seq 1 20000")
    assert code == 0
    assert out.startswith("1\n2\n3\n") and out.endswith("19999\n20000\n")
    total = sum(len(f"{i}\n") for i in range(1, 20001))
    assert f"[... {total - 1000} bytes of output omitted ...]" in out


@needs_jail
def test_the_repository_copy_has_a_disk_quota():
    """A writer that never stops is killed by the quota, not the wall clock; `du` (coreutils, an
    independent count) says what it left: at most the quota where the copy is in a size-capped area
    (the kernel refused the rest), past it where the quota is polled; a later command may clean up."""
    quota = 8 << 20
    limits = EnvLimits(command=JailLimits(wall_seconds=30, cpu_seconds=30, disk_bytes=quota, file_bytes=1 << 20))
    with RepoEnv(RepoTask("t", "t", CALC, CALL_TESTS), limits) as env:
        out, code = env.run("head -c 4096 /dev/urandom > small.bin && echo ok")
        assert (out, code) == ("ok\n", 0)  # under the quota nothing changes
        out, code = env.run("i=0; while :; do head -c 262144 /dev/urandom > f$i; i=$((i+1)); sleep 0.01; done")
        note = f"[the repository reached its size limit ({quota >> 20} MiB or 20000 new files); the command was killed]"
        assert code == 1 and out.endswith(note)
        du = subprocess.run(["du", "-s", "--block-size=1", str(env.repo)], capture_output=True, text=True)
        if fs.areas_supported()[0]:
            assert quota - (1 << 20) < int(du.stdout.split()[0]) <= quota
        else:
            assert int(du.stdout.split()[0]) > quota
        # over the quota from the start: commands that do not grow the copy still run
        assert env.run("rm f* && ls") == ("calc.py\nsmall.bin\n", 0)
        assert env.grade().reward == 0.0  # the grader still runs on the cleaned copy (add() subtracts)


@needs_jail
def test_grade_never_raises_on_a_broken_repository():
    broken = {"calc.py": "def add(a, b):\n    return a +\n"}
    with RepoEnv(RepoTask("t", "t", broken, CALL_TESTS)) as env:
        res = env.grade()
        assert res.reward == 0.0 and res.details["reason"] == "crash"
        env.run("rm calc.py; mkdir calc.py; chmod 000 calc.py")
        assert env.grade().reward == 0.0
    with RepoEnv(RepoTask("t", "t", CALC, CALL_TESTS)) as env:
        env.run("echo 'import os; os._exit(0)' > calc.py")
        assert env.grade().details["reason"] == "protocol_error"


def test_run_before_reset_is_refused():
    with pytest.raises(RuntimeError, match="reset"):
        RepoEnv(RepoTask("t", "t", CALC, CALL_TESTS)).run("ls")


def test_snapshots_from_archives_and_unsafe_paths(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "pkg").mkdir()
    (src / "pkg" / "m.py").write_text("X = 1\n")
    archive = tmp_path / "snap.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src / "pkg", arcname="pkg")
    for snapshot in (src, archive):
        dest = tmp_path / f"out-{snapshot.name}"
        dest.mkdir()
        materialize(snapshot, dest)
        assert (dest / "pkg" / "m.py").read_text() == "X = 1\n"
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 0
        tar.addfile(info)
    (tmp_path / "out-evil").mkdir()
    with pytest.raises(Exception):  # noqa: B017 - tarfile's filter error or ours, both refuse
        materialize(evil, tmp_path / "out-evil")
    assert not (tmp_path / "escaped.txt").exists()
    with pytest.raises(ValueError, match="leaves the repository"):
        materialize({"../x.py": ""}, tmp_path / "out-evil")


@needs_jail
def test_swe_bench_layout_loader_and_grading(tmp_path):
    snap = tmp_path / "snaps" / "demo__app-1"
    snap.mkdir(parents=True)
    (snap / "app.py").write_text('NAME = "app"\n\n\ndef answer():\n    return 41\n')
    row = {
        "instance_id": "demo__app-1", "repo": "demo/app", "base_commit": "abc123",
        "problem_statement": "answer() is off by one", "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": json.dumps([unittest_id("test_answer")]),
        "PASS_TO_PASS": [unittest_id("test_name")],
        "test_command": "python3 -m unittest -v test_app",
        "log_parser": "django",  # swebench's parser of `unittest -v` lines
    }  # fmt: skip
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text(json.dumps(row) + "\n\n")
    (task,) = load_jsonl(jsonl, tmp_path / "snaps")
    assert task.task_id == "demo__app-1" and task.snapshot == snap and task.meta["repo"] == "demo/app"
    assert task.hidden_tests.fail_to_pass == (unittest_id("test_answer"),)
    with RepoEnv(task) as env:
        assert env.run("ls")[0].split() == ["app.py"]  # the test patch is not in the agent's copy
        before = env.grade()
        assert before.reward == 0.0 and before.details["statuses"][unittest_id("test_name")] == "PASSED"
        env.run("sed -i 's/41/42/' app.py")
        after = env.grade()
        assert after.reward == 1.0, after.details
        assert env.run("ls")[0].split() == ["app.py"]


def test_loader_defaults_and_errors(tmp_path):
    (tmp_path / "x-1.tar.gz").write_bytes(b"")
    row = {"instance_id": "x-1", "problem_statement": "p", "test_patch": TEST_PATCH}
    (tmp_path / "a.jsonl").write_text(json.dumps(row) + "\n")
    (task,) = load_jsonl(tmp_path / "a.jsonl")
    assert task.snapshot == tmp_path / "x-1.tar.gz"
    assert task.hidden_tests.command == "python -m pytest -rA test_app.py"
    assert task.hidden_tests.fail_to_pass == ()
    (tmp_path / "b.jsonl").write_text(json.dumps({"instance_id": "nope", "problem_statement": "p"}) + "\n")
    with pytest.raises(ValueError, match="no snapshot"):
        load_jsonl(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text(json.dumps({"instance_id": "x-1"}) + "\n")
    with pytest.raises(ValueError, match="problem_statement"):
        load_jsonl(tmp_path / "c.jsonl")


# -- the embedded repo-repair tasks ----------------------------------------------------------------

# Every template function restated independently: (module, name) -> implementation.
ORACLE = {
    ("stats", "mean"): lambda v: sum(v) / len(v),
    ("stats", "clamp"): lambda x, lo, hi: max(lo, min(hi, x)),
    ("stats", "running_max"): lambda v: [max(v[: i + 1]) for i in range(len(v))],
    ("text", "count_vowels"): lambda t: len([c for c in t if c in "aeiouAEIOU"]),
    ("text", "truncate"): lambda t, w: t if len(t) <= w else t[: w - 1] + "~",
    ("text", "initials"): lambda n: ".".join(w[:1].upper() for w in n.split()),
    ("seq", "chunk"): lambda v, n: [v[i : i + n] for i in range(0, len(v), n)],
    ("seq", "rotate"): lambda v, k: v[k % len(v) :] + v[: k % len(v)] if v else [],
    ("seq", "dedupe"): lambda v: list(dict.fromkeys(v)),
}


def test_repo_tasks_are_deterministic_and_their_hidden_tests_match_the_oracle():
    tasks = make_repo_tasks(60, 3)
    assert tasks == make_repo_tasks(60, 3) and tasks != make_repo_tasks(60, 4)
    assert make_repo_tasks(10, 3) == tasks[:10]
    assert {t.meta["family"] for t in tasks} == set(BUG_FAMILIES)
    for task in tasks:
        assert 1 <= task.meta["fail_to_pass"] <= 3 and task.meta["pass_to_pass"] >= 4
        for test in task.hidden_tests:
            fn = ORACLE[(test.module.split(".")[1], test.function)]
            assert fn(*test.args) == test.expected, (task.task_id, test)
        module = task.meta["function"].split(".")[0]
        assert f"toolkit/{module}.py" in task.snapshot and "fix" in task.meta
        assert sum(len(text) for text in task.snapshot.values()) < 4000
    with pytest.raises(ValueError, match="families"):
        make_repo_tasks(2, 0, families=["typo"])


def test_a_family_filter_plants_only_that_family():
    assert {t.meta["family"] for t in make_repo_tasks(12, 1, families=["off_by_one"])} == {"off_by_one"}


@needs_jail
@pytest.mark.parametrize("index", range(6))
def test_repo_tasks_fail_before_and_pass_after_the_reference_fix(index):
    task = make_repo_tasks(6, 11)[index]
    with RepoEnv(task) as env:
        out, code = env.run("python3 -m unittest discover -s tests 2>&1 | tail -1")
        assert (out, code) == ("OK\n", 0)  # the visible tests cover only the healthy functions
        assert env.grade().reward == 0.0
        ((path, fixed),) = task.meta["fix"].items()
        diff = difflib.ndiff((env.repo / path).read_text().splitlines(), fixed.splitlines())
        assert 1 <= sum(line[:2] in ("- ", "+ ") for line in diff) <= 2  # a one-line fix
        (env.repo / path).write_text(fixed)
        assert env.grade().reward == 1.0, task.meta


def test_swebench5_task_directories_load_like_their_jsonl_row(tmp_path):
    # the directory written with swebench's own writers (task.yaml, tests.json, the patches as files)
    from swebench.task import repo as swe_repo

    from areal_npu.agent.tasksets import load

    row = {"instance_id": "demo__app-1", "repo": "demo/app", "base_commit": "abc123", "version": "1.0",
           "problem_statement": "answer() is off by one\n", "test_patch": TEST_PATCH, "patch": "",
           "FAIL_TO_PASS": [unittest_id("test_answer")], "PASS_TO_PASS": [unittest_id("test_name")],
           "image_name": "demo-image", "log_parser": "django"}  # fmt: skip
    (tmp_path / "demo-image").mkdir()  # a prepared root filesystem beside the set
    (tmp_path / "set.jsonl").write_text(json.dumps(row) + "\n")
    task_dir = tmp_path / "repo" / swe_repo.TASKS_SUBDIR / row["instance_id"]
    task_dir.mkdir(parents=True)
    keys = {k: v for k, v in row.items() if k not in (*swe_repo.AS_FILE, *swe_repo.TEST_KEYS)}
    (task_dir / swe_repo.TASK_FILE).write_text(swe_repo.dump_yaml(keys))
    (task_dir / swe_repo.TESTS_FILE).write_text(swe_repo.dump_tests({k: row[k] for k in swe_repo.TEST_KEYS}))
    for column, name in swe_repo.AS_FILE.items():
        (task_dir / name).write_text(row.get(column, ""))
    (from_jsonl,) = load(tmp_path / "set.jsonl", image_root=tmp_path)
    for path in (task_dir, tmp_path / "repo"):  # one task directory, and a task repository (tasks/)
        (task,) = load(path, image_root=tmp_path)
        assert (task.task_id, task.problem_statement, task.hidden_tests) == (
            from_jsonl.task_id, from_jsonl.problem_statement, from_jsonl.hidden_tests)  # fmt: skip
        assert task.image == str(tmp_path / "demo-image") == from_jsonl.image and task.workdir == "/testbed"
        assert task.snapshot is None  # the image ships the repository
    with pytest.raises(ValueError, match="neither a JSONL file"):
        load(tmp_path / "demo-image")


def test_r2e_gym_rows_load_with_their_own_fields():
    from areal_npu.agent.tasksets import from_row

    row = json.loads((Path(__file__).parent / "data" / "r2e_gym_row.json").read_text())
    task = from_row(row, Path("/nonexistent"))
    assert task.task_id == f"{row['repo_name']}__{row['commit_hash'][:8]}"
    assert task.image == row["docker_image"] and task.workdir == "/testbed" and task.snapshot is None
    tests = task.hidden_tests
    assert tests.command == "bash run_tests.sh" and tests.expected_statuses == json.loads(row["expected_output_json"])
    assert set(tests.hidden_paths) == {"run_tests.sh", "r2e_tests"}  # kept out of the agent's copy
