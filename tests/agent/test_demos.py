"""The warm start's shell-agent demonstrations on the embedded repo tasks (areal_npu.agent.demos).

References, independent of the recording code: each demonstration's commands are run by hand in a
fresh jailed copy (no agent) and judged by the hidden tests (``RepoEnv.grade``), by the generator's
reference fix (the module must equal it byte for byte) and by the submission convention; the
training sample's tokens and loss mask are rebuilt as ChatML text pieces, each encoded by the
tokenizer, with the observations taken from that hand run."""

import dataclasses
import difflib
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from areal_npu import cli
from areal_npu.agent import actions
from areal_npu.agent.demos import demo_samples, demo_turns, record_demos
from areal_npu.agent.environments import RepoEnv
from areal_npu.agent.jail import backend
from areal_npu.agent.repo_tasks import FUNCTIONS, make_repo_tasks
from areal_npu.agent.tasks import make_splits
from areal_npu.config import ConfigError, load_config
from areal_npu.model.tiny import build_tokenizer
from areal_npu.recipe import RLConfig

JAIL_OK, JAIL_WHY = backend("bwrap").available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "code_agent.yaml"
# The short warm start of the last test, on two-turn demonstrations (fix, submit), and its floor of
# well-formed greedy turns on held-out tasks. Measured with scripts/measure_demo_warmstart.py
# (docs/BENCHMARKS.md, "Code agent warm start"; lr 1e-2, batch 4, 16 demonstrations, 8 held-out
# tasks): 48 steps gave 1.00 on seeds 1, 2 and 3 (16 turns each); 24 steps gave 1.00, 1.00, 0.44,
# 0.00, so fewer steps are a coin flip. The floor 0.75 allows two episodes' turns to go wrong.
WARM_STEPS, WARM_BATCH, WARM_LR, WARM_DEMOS, HELD_OUT = 48, 4, 1e-2, 16, 8
AFTER_FLOOR = 0.75
ALL_BUGS = {(f"{f.module}.{f.name}", family) for f in FUNCTIONS for family, _, _ in f.bugs}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def recipe():
    return load_config(RLConfig, RECIPE, [])


def one_task_per_bug() -> list:
    seen = {}
    for task in make_repo_tasks(400, seed=11):
        seen.setdefault((task.meta["function"], task.meta["family"]), task)
    assert set(seen) == ALL_BUGS, f"the generator did not produce {ALL_BUGS - set(seen)} in 400 tasks"
    return list(seen.values())


def hand_run(task, turns):
    """Each turn's command run in a fresh copy, no agent: ``[(exit code, output)]``, the fixed
    module's text and the grade."""
    ((path, _),) = task.meta["fix"].items()
    observed = []
    with RepoEnv(task) as env:
        for turn in turns:
            action = actions.parse_action(turn)
            assert action.command is not None, turn
            output, code = env.run(action.command)
            observed.append((code, output))
        return observed, (env.repo / path).read_text(), env.grade()


def test_the_demonstration_of_every_bug_kind_fixes_the_repository_and_submits():
    for task in one_task_per_bug():
        ((path, fixed),) = task.meta["fix"].items()
        turns = demo_turns(task, max_turns=4)
        observed, module, grade = hand_run(task, turns)
        why = f"{task.meta['function']} {task.meta['family']}: {turns[1]}"
        assert all(code == 0 for code, _ in observed), (why, observed)
        assert module == fixed, why
        n_tests = task.meta["fail_to_pass"] + task.meta["pass_to_pass"]
        assert grade.reward == 1.0 and grade.details["passed"] == grade.details["total"] == n_tests, why
        assert actions.is_submission(observed[-1][1]) and not any(
            actions.is_submission(o) for _, o in observed[:-1]
        )


def test_the_turn_budget_drops_the_test_run_then_the_look_then_the_submission():
    task = one_task_per_bug()[0]
    commands = {n: [actions.parse_action(t).command for t in demo_turns(task, n)] for n in (1, 2, 3, 4, 9)}
    fix = commands[4][1]
    assert fix.startswith("sed -i ") and commands[9] == commands[4]
    assert commands[4][2:] == ["python -m unittest discover -s tests", f"echo {actions.SUBMIT_MARKER}"]
    assert commands[3] == [commands[4][0], fix, commands[4][3]]
    assert commands[2] == [fix, commands[4][3]] and commands[1] == [fix]


def code_tokens(source: str) -> list[str]:
    """Python's own tokenizer: the token strings of ``source`` (layout tokens dropped)."""
    skip = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]


def test_the_recipe_tier_plants_a_small_edit_the_hidden_tests_catch_and_the_demonstration_fixes(recipe):
    """The recipe's easy tier (``task.families``): every planted bug is one edit of at most two
    Python tokens (the tokenizer on the broken module and the generator's reference fix); the
    hidden tests fail on the planted module and pass on the original; each bug's demonstration,
    run by hand in the jail, fixes it; the held-out tasks are new instances of the training bugs."""
    train, held_out = make_splits(recipe.task)
    assert recipe.task.families, "the recipe trains on the full bug mix again: update this test and the docs"
    bugs = {(t.meta["function"], t.meta["family"]) for t in train}
    assert {(t.meta["function"], t.meta["family"]) for t in held_out} <= bugs
    copies = {(t.problem_statement, tuple(sorted(t.snapshot.items()))) for t in train}
    assert not any((t.problem_statement, tuple(sorted(t.snapshot.items()))) in copies for t in held_out)
    one_per_bug = {}
    for task in train:
        one_per_bug.setdefault((task.meta["function"], task.meta["family"]), task)
    for task in [*one_per_bug.values(), *held_out[:2]]:
        ((path, fixed),) = task.meta["fix"].items()
        before, after = code_tokens(task.snapshot[path]), code_tokens(fixed)
        ops = difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes()
        edits = [max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal"]
        assert len(edits) == 1 and edits[0] <= 2, (task.meta, ops)
        with RepoEnv(task) as env:
            assert env.grade().reward == 0.0, task.meta  # the hidden tests see the bug
            (env.repo / path).write_text(fixed)
            assert env.grade().reward == 1.0, task.meta
        _, module, grade = hand_run(task, demo_turns(task, recipe.warmstart.demo_turns))
        assert module == fixed and grade.reward == 1.0, task.meta


@pytest.fixture(scope="module")
def recorded(tok, recipe):
    """The recipe's training tasks, recorded through the shell agent as the warm start does."""
    train, _ = make_splits(recipe.task)
    return train, record_demos(train, recipe.workflow, tok)


def test_every_recorded_demonstration_submits_and_gets_reward_one(recorded, recipe):
    train, trajs = recorded
    assert [t.meta["task_id"] for t in trajs] == [t.task_id for t in train]
    for traj in trajs:
        stats = traj.meta["stats"]
        assert traj.reward == 1.0 and traj.meta["end"] == "submitted", traj.meta
        assert stats["turns"] == recipe.workflow.max_turns and stats["format_errors"] == 0
        assert stats["tokens"] <= recipe.workflow.shell.max_tokens


def chatml(role, content):
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def test_the_sample_trains_exactly_the_assistant_turns(recorded, recipe, tok):
    train, _ = recorded
    tasks = train[:6]
    samples = demo_samples(tok, tasks, recipe.workflow)
    system = recipe.workflow.shell.system_prompt
    for task, sample in zip(tasks, samples):
        turns = demo_turns(task, recipe.workflow.max_turns)
        observed, _, _ = hand_run(task, turns)
        prompt = chatml("system", system) + chatml(
            "user", actions.TASK_PROMPT.format(problem=task.problem_statement)
        )
        pieces = [(prompt + "<|im_start|>assistant\n", 0)]
        for i, turn in enumerate(turns):
            pieces.append((turn + "<|im_end|>", 1))
            if i < len(turns) - 1:  # the submission ends the episode: no observation after it
                code, output = observed[i]
                content = f"<returncode>{code}</returncode>\n<output>\n{output}</output>"
                pieces.append(("\n" + chatml("user", content) + "<|im_start|>assistant\n", 0))
        ids, mask = [], []
        for text, trained in pieces:
            encoded = tok.encode(text, add_special_tokens=False)
            ids += encoded
            mask += [trained] * len(encoded)
        got = sample.input_ids.tolist()
        assert sample.loss_mask.tolist() == [bool(m) for m in mask] and len(got) == len(ids)
        assert [i for i, m in zip(got, mask) if m] == [i for i, m in zip(ids, mask) if m]
        # the two runs of the tests may differ in their timing ("Ran 5 tests in 0.001s") only
        assert untimed(tok.decode(got)) == untimed(tok.decode(ids))


def untimed(text):
    return re.sub(r"(Ran \d+ tests? in )\d+\.\d+s", r"\1<t>s", text)


def test_a_turn_longer_than_max_new_tokens_is_refused_naming_the_option(tok, recipe):
    workflow = dataclasses.replace(recipe.workflow, max_new_tokens=24)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        record_demos(make_repo_tasks(1, seed=2), workflow, tok)


def test_the_recipe_accepts_a_warm_start_on_embedded_tasks_and_refuses_it_on_a_task_set(tmp_path, capsys):
    assert cli.main(["train", str(RECIPE), "--check", "warmstart.steps=3"]) == 0
    capsys.readouterr()
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("")
    # task.families=[]: the recipe's easy tier selects embedded tasks, which a task set refuses first
    code = cli.main(
        ["train", str(RECIPE), "--check", "warmstart.steps=3", "task.families=[]", f"task.dataset={jsonl}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("config error: warmstart.steps: "), err
    # ... unless the demonstrations come from embedded tasks of their own (a dataset has no fixes)
    assert cli.main(["train", str(RECIPE), "--check", "warmstart.demo_tasks=4", "warmstart.steps=0"]) == 2
    assert "warmstart.demo_tasks" in capsys.readouterr().err


def test_mini_swe_agent_demonstrations_are_recorded_through_its_harness(tok, recipe):
    # the same episodes in mini-swe-agent's action format, run by mini-swe-agent through the gateway:
    # every written turn parses (no format error), the fix is graded 1 (_record checks both)
    shell = dataclasses.replace(recipe.workflow.shell, harness="mini_swe_agent", system_prompt="",
                                harness_config={"agent": {"system_template": "Fix it.", "instance_template": "{{task}}"}})  # fmt: skip
    workflow = dataclasses.replace(recipe.workflow, shell=shell, max_new_tokens=256, max_turns=2)
    (traj,) = record_demos(make_repo_tasks(1, seed=4), workflow, tok)
    assert traj.meta["harness"] == "mini_swe_agent" and traj.meta["end"] == "submitted" and traj.segments == []
    assert "```mswea_bash_command" in tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m])


# ---- the warm start on demonstrations, judged by greedy episodes through transformers (no vLLM) ----
def well_formed(text: str) -> bool:
    """The agent's parser finds the command, a reasoning line comes before the block, and the turn
    is just that: two fences, nothing after the closing one (the parser alone also accepts a turn
    that repeats ```bash openings until the token limit: the second opening closes the first)."""
    reason, _, rest = text.partition("```bash")
    return (
        actions.parse_action(text).command is not None
        and bool(reason.strip())
        and text.count("```") == 2
        and rest.rstrip().endswith("```")
    )


def test_the_well_formed_judge_on_written_turns():
    good = "Read it.\n```bash\ncat a.py\n```"
    assert well_formed(good) and well_formed(good + "\n")
    assert not well_formed("```bash\ncat a.py\n```")  # no reasoning
    assert not well_formed("Read it.\n```bash\n\n```")  # empty
    assert not well_formed(good + "\n```bash\nls\n```")  # two blocks
    repeated = "Submit.\n```bash\necho DONE\n```bash\necho DON"  # one block to the parser
    assert actions.parse_action(repeated).command == "echo DONE" and not well_formed(repeated)


@pytest.fixture
def one_thread():
    """One torch thread: on a loaded 2-core machine two threads spin against each other (a
    training step measured 10x slower with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.full  # CI: the code-agent recipe's e2e (its warm start, then RL turns that run commands)
def test_a_short_warm_start_on_demonstrations_makes_greedy_turns_well_formed(tmp_path, recipe, one_thread):
    """The recipe's warm start, shortened to 16 demonstrations: before it no greedy first turn is
    well formed, after it at least AFTER_FLOOR of the greedy turns on 8 held-out tasks are, and
    their commands ran in the jail. Two-turn demonstrations keep the samples at ~700 tokens; one
    torch thread (see ``one_thread``). The numbers behind WARM_* and the floor are above them."""
    from rich.console import Console

    from areal_npu.agent.demos import greedy_episodes
    from areal_npu.model.tiny import save_tiny_model
    from areal_npu.train.dist import init_distributed
    from areal_npu.warmstart import WarmStartConfig, warm_start

    init_distributed()
    torch.manual_seed(0)
    workflow = dataclasses.replace(recipe.workflow, max_turns=2)
    # The full bug mix, which WARM_* and the floor were measured on. On the recipe's easy tier (two
    # fixes) these 16 demonstrations collapsed the model into one repeated sed on one machine (0 of
    # 16 well formed, with transformers 5.18 and 5.19 alike; the mix: 16 of 16) while the same test
    # passed on CI's: 16 demonstrations of two near-identical fixes are a knife edge, the mix is not.
    train, held_out = make_splits(dataclasses.replace(recipe.task, families=[]))
    demos = train[:WARM_DEMOS]
    # not a demonstrated task, nor the same issue in another repository copy (the split keeps those)
    held_out = [t for t in held_out if t.problem_statement not in {d.problem_statement for d in demos}]
    held_out = held_out[:HELD_OUT]
    assert len(held_out) == HELD_OUT
    base = save_tiny_model(tmp_path / "base", recipe.model.tiny)
    one_turn = dataclasses.replace(workflow, max_turns=1)
    first_turns, _ = greedy_episodes(base, held_out[:2], one_turn, recipe.mtp)
    assert not any(map(well_formed, first_turns)), first_turns
    short = WarmStartConfig(steps=WARM_STEPS, batch_size=WARM_BATCH, lr=WARM_LR, log_every=WARM_STEPS)
    out = warm_start(base, demos, tmp_path / "warm", Console(quiet=True), cfg=short, train=recipe.train,
                     mtp=recipe.mtp, seed=0, workflow=workflow)  # fmt: skip
    texts, trajs = greedy_episodes(out, held_out, workflow, recipe.mtp)
    stats = [t.meta["stats"] for t in trajs]
    ran = sum(s["turns"] - s["format_errors"] for s in stats)
    print(f"well-formed turns {sum(map(well_formed, texts))}/{len(texts)}, commands ran {ran:g}, "
          f"submitted {sum(s['submitted'] for s in stats):g}/{len(stats)}, solved {sum(s['reward'] for s in stats):g}")  # fmt: skip
    assert len(texts) == sum(s["turns"] for s in stats) >= len(held_out)
    assert sum(map(well_formed, texts)) >= AFTER_FLOOR * len(texts), texts
    assert ran >= AFTER_FLOOR * len(texts)  # the parsed commands ran in the jail
