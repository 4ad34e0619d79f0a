"""`areal-npu tasks validate`: every instance run three ways (empty patch, gold patch, tampered tests)
in its environment. References: tasks written here by hand whose right answers are known (a fix that
makes the hidden test pass; a task already solved; a gold patch that fixes nothing), the exit codes
the command documents, and the JSON it writes agreeing with the table's rows."""

from __future__ import annotations

import json

import pytest

from areal_npu import tasks_cli
from areal_npu.agent import env_backends
from areal_npu.agent.jail import backend
from areal_npu.agent.tasksets import load_jsonl
from areal_npu.agent.validate import check_task, forged_tests
from tests.support.unittest_task import BUGGY, TEST_PATCH, unittest_id

JAIL_OK, JAIL_WHY = backend("bwrap").available()
needs_jail = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")

GOLD = "".join(  # a blank context line of a diff is one space: spelled out, not trailing whitespace
    line + "\n"
    for line in ["diff --git a/app.py b/app.py", "--- a/app.py", "+++ b/app.py", '@@ -2,4 +2,4 @@ NAME = "app"',
                 " ", " ", " def answer():", "-    return 41", "+    return 42"]
)  # fmt: skip


def _write_set(tmp_path, sources: dict[str, str], gold: dict[str, str]):
    rows = []
    for task_id, source in sources.items():
        snap = tmp_path / task_id
        snap.mkdir()
        (snap / "app.py").write_text(source)
        rows.append({"instance_id": task_id, "problem_statement": "answer() is off by one",
                     "test_patch": TEST_PATCH, "patch": gold[task_id],
                     "FAIL_TO_PASS": [unittest_id("test_answer")], "PASS_TO_PASS": [unittest_id("test_name")],
                     "test_command": "python3 -m unittest -v test_app", "log_parser": "django"})  # fmt: skip
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _validate(capsys, *argv: str) -> tuple[int, str]:
    import argparse

    parser = argparse.ArgumentParser()
    tasks_cli.add_arguments(parser)
    code = tasks_cli.run(parser.parse_args(["validate", *argv]))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@needs_jail
def test_a_valid_set_passes_and_broken_instances_are_named(tmp_path, capsys):
    good = _write_set(tmp_path, {"demo__ok-1": BUGGY}, {"demo__ok-1": GOLD})
    code, out = _validate(capsys, str(good), "--backend", "bwrap", "--json", str(tmp_path / "ok.json"))
    report = json.loads((tmp_path / "ok.json").read_text())
    assert code == 0, out
    (row,) = report["rows"]
    assert (row["empty"], row["gold"], row["tamper"], row["valid"]) == (0.0, 1.0, 0.0, True)
    assert report["summary"]["gold_pass_rate"] == 1.0 and report["backend"] == "bwrap"
    assert "valid 1/1" in out and len(row["grade_s"]) == 3

    # already solved (the empty patch passes), and a gold patch that does not touch the bug
    fixed = BUGGY.replace("41", "42")
    noop = GOLD.replace("-    return 41\n+    return 42", "-    return 41\n+    return 41  # unchanged")
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = _write_set(bad_dir, {"demo__solved-1": fixed, "demo__nogold-1": BUGGY},
                     {"demo__solved-1": "", "demo__nogold-1": noop})  # fmt: skip
    code, out = _validate(capsys, str(bad), "--backend", "bwrap", "--json", str(tmp_path / "bad.json"))
    rows = {r["task_id"]: r for r in json.loads((tmp_path / "bad.json").read_text())["rows"]}
    assert code == tasks_cli.EXIT_INVALID
    assert rows["demo__solved-1"]["empty"] == 1.0 and not rows["demo__solved-1"]["valid"]
    assert rows["demo__nogold-1"]["gold"] == 0.0 and not rows["demo__nogold-1"]["valid"]
    assert "valid 0/2" in out


def test_forged_tests_stub_every_fail_to_pass_test(tmp_path):
    row = {"instance_id": "x-1", "problem_statement": "p", "test_patch": "+++ b/tests/test_a.py\n+++ b/tests/test_b.py\n",
           "FAIL_TO_PASS": ["tests/test_a.py::test_one", "tests/test_a.py::TestK::test_two[1-2]"]}  # fmt: skip
    (tmp_path / "x-1").mkdir()
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    (task,) = load_jsonl(tmp_path / "t.jsonl")
    forged = forged_tests(task)
    assert set(forged) == {"tests/test_a.py", "tests/test_b.py"} and forged["tests/test_b.py"] == ""
    namespace: dict = {}
    exec(forged["tests/test_a.py"], namespace)  # the stubs are valid Python defining the named tests
    assert callable(namespace["test_one"]) and callable(namespace["TestK"]().test_two)


def test_bad_input_and_an_unstartable_backend_exit_2(tmp_path, capsys, monkeypatch):
    code, _ = _validate(capsys, str(tmp_path / "missing.jsonl"))
    assert code == tasks_cli.EXIT_INPUT
    good = _write_set(tmp_path, {"demo__ok-1": BUGGY}, {"demo__ok-1": GOLD})
    for name in ("bwrap", "podman", "docker", "apptainer"):  # nothing isolated starts here
        monkeypatch.setattr(env_backends.get(name), "available", lambda name=name: (False, f"{name} faked away"))
    code, err = _validate(capsys, str(good), "--backend", "auto")
    assert code == tasks_cli.EXIT_INPUT and "bwrap faked away" in err
    code, out = _validate(capsys, str(good), "--backend", "auto", "--fallback", "process", "--limit", "1")
    assert code == 0 and "backend process" in out  # the weaker backend only when it is named


def test_check_task_reports_a_task_without_gold_as_an_error(tmp_path):
    path = _write_set(tmp_path, {"demo__x-1": BUGGY}, {"demo__x-1": ""})
    (task,) = load_jsonl(path)
    check = check_task(task, env_backends.get("process"))
    assert not check.valid and "no gold patch" in check.error and check.gold is None
