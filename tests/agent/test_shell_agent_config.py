"""The shell agent's options and the repo task source: `areal-npu train RECIPE --check` accepts the
code-agent recipe and refuses each bad or unread option with exit 2 and a line naming its key."""

from pathlib import Path

import pytest

from areal_npu import cli
from areal_npu.agent.jail import backend
from areal_npu.agent.repo_task import RepoTask
from areal_npu.agent.tasks import TaskConfig, make_splits

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "code_agent.yaml"
JAIL_OK, JAIL_WHY = backend("bwrap").available()
needs_jail = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")


@pytest.fixture(autouse=True)
def machine_decides(monkeypatch):
    monkeypatch.setenv("AREAL_NPU_DEVICE", "")
    monkeypatch.delenv("AREAL_NPU_DEVICE")
    yield
    from areal_npu.platform import current_platform

    current_platform.cache_clear()


def check(capsys, *overrides):
    code = cli.main(["train", str(RECIPE), "--check", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


@needs_jail
def test_the_code_agent_recipe_and_its_ci_variant_pass(capsys):
    assert check(capsys) == (0, [])
    ci = ("controller.steps=2", "workflow.group_size=2", "workflow.max_turns=3")
    assert check(capsys, *ci) == (0, [])


@needs_jail
@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["workflow.shell.max_tokens=0"], "workflow.shell.max_tokens", ">= 1"),
        (["workflow.shell.max_tokens=90"], "workflow.shell.max_tokens", "no room"),
        (["workflow.shell.observation_role=bot"], "workflow.shell.observation_role", "user, tool"),
        (["workflow.shell.observation_chars=50"], "workflow.shell.observation_chars", ">= 200"),
        (["workflow.shell.env_workers=0"], "workflow.shell.env_workers", ">= 1"),
        (["workflow.shell.command_timeout_s=0"], "workflow.shell.command_timeout_s", "> 0"),
        (["workflow.shell.repo_disk_mib=0"], "workflow.shell.repo_disk_mib", ">= 1"),
        (["workflow.shell.env.backend=nsjail"], "workflow.shell.env.backend", "bwrap"),
        (["workflow.shell.env.fallback=nsjail"], "workflow.shell.env.fallback", "process"),
        (["workflow.turn_discount=0.9"], "workflow.turn_discount", "not read by"),
        (["workflow.reward_workers=4"], "workflow.reward_workers", "not read by"),
        (["workflow.shell.tool_parser=hermes"], "workflow.shell.tool_parser", "shell harness"),
        (["task.level=medium"], "task.level", "program-task option"),
        (["task.families=[nope]"], "task.families", "not bug families"),
        (["task.kind=bogus"], "task.kind", "program or repo"),
        (["task.families=[]", "task.dataset=/nonexistent.jsonl"], "task.dataset", "does not exist"),
        (["task.families=[]", "task.image_root=/x"], "task.image_root", "task.dataset only"),
    ],
)
def test_bad_options_are_refused_naming_the_key(capsys, overrides, key, fragment):
    code, err = check(capsys, *overrides)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"config error: {key}: "), err
    assert fragment in err[0], err


def test_shell_options_are_refused_for_a_workflow_that_does_not_read_them(capsys):
    code, err = check(capsys, "workflow.path=areal_npu.agent.workflows.SingleTurn", "task.kind=program",
                      "task.families=[]", "task.n_train=400")  # fmt: skip
    assert code == 2 and err[0].startswith("config error: workflow.max_turns: ") and "not read by" in err[0]
    code, err = check(capsys, "workflow.path=areal_npu.agent.workflows.MultiTurn", "task.kind=program",
                      "task.families=[]", "task.n_train=400")  # fmt: skip
    assert code == 2 and err[0].startswith("config error: workflow.shell: ") and "not read by" in err[0]


def test_program_tasks_refuse_a_dataset():
    for key in ("dataset", "image_root", "snapshots"):
        with pytest.raises(ValueError, match=key):
            TaskConfig(**{key: "x"}).validate()


def test_repo_splits_are_repo_tasks_with_disjoint_eval():
    train, evals = make_splits(TaskConfig(kind="repo", n_train=12, n_eval=6, seed=2, families=["off_by_one"]))
    assert len(train) == 12 and len(evals) == 6
    assert all(isinstance(t, RepoTask) and t.meta["family"] == "off_by_one" for t in train + evals)
    key = lambda t: (t.problem_statement, tuple(sorted(t.snapshot.items())))  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in evals}


def test_a_dataset_splits_in_file_order(tmp_path):
    import json

    rows = [
        {"instance_id": f"t{i}", "problem_statement": f"fix {i}", "test_command": "true"} for i in range(4)
    ]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        (tmp_path / r["instance_id"]).mkdir()
    cfg = TaskConfig(kind="repo", n_train=2, n_eval=5, dataset=str(tmp_path / "set.jsonl"))
    train, evals = make_splits(cfg)
    assert [t.task_id for t in train] == ["t0", "t1"] and [t.task_id for t in evals] == ["t2", "t3"]
    with pytest.raises(ValueError, match="n_train"):
        make_splits(TaskConfig(kind="repo", n_train=5, dataset=str(tmp_path / "set.jsonl")))


@needs_jail
def test_no_cgroup_is_refused_unless_the_recipe_allows_it(capsys, monkeypatch):
    from areal_npu.agent import cgroups

    monkeypatch.setattr(cgroups, "probe", lambda: (False, "cgroup v2 group / does not delegate pids (test)"))
    code, err = check(capsys, "workflow.shell.env.allow_no_cgroup=false")
    assert (
        code == 2
        and len(err) == 1
        and err[0].startswith("config error: workflow.shell.env.allow_no_cgroup: ")
    )
    assert "does not delegate pids (test)" in err[0], err
    assert check(capsys) == (0, [])  # the CPU recipe allows it (laptops, CI)
