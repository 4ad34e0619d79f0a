"""The warm start's shell-agent demonstrations on the embedded repo tasks (areal_npu.agent.demos).

References, independent of the recording code: each demonstration's commands are run by hand in a
fresh jailed copy (no agent) and judged by the hidden tests (``RepoEnv.grade``), by the generator's
reference fix (the module must equal it byte for byte) and by the submission convention; the
training sample's tokens and loss mask are rebuilt as ChatML text pieces, each encoded by the
tokenizer, with the observations taken from that hand run."""

import asyncio
import re
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
from areal_npu.rollout.client import GenerationResult, GenerationSample

JAIL_OK, JAIL_WHY = backend("bwrap").available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "code_agent.yaml"
WARM_STEPS = 24  # the short warm start of the last test (the recipe runs more)
AFTER_FLOOR = 0.6  # well-formed greedy turns after it; measured: see the test's docstring
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
        assert actions.is_submission(observed[-1][1]) and not any(actions.is_submission(o) for _, o in observed[:-1])


def test_the_turn_budget_drops_the_test_run_then_the_look_then_the_submission():
    task = one_task_per_bug()[0]
    commands = {n: [actions.parse_action(t).command for t in demo_turns(task, n)] for n in (1, 2, 3, 4, 9)}
    fix = commands[4][1]
    assert fix.startswith("sed -i ") and commands[9] == commands[4]
    assert commands[4][2:] == ["python -m unittest discover -s tests", f"echo {actions.SUBMIT_MARKER}"]
    assert commands[3] == [commands[4][0], fix, commands[4][3]]
    assert commands[2] == [fix, commands[4][3]] and commands[1] == [fix]


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
        prompt = chatml("system", system) + chatml("user", actions.TASK_PROMPT.format(problem=task.problem_statement))
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
    import dataclasses

    workflow = dataclasses.replace(recipe.workflow, max_new_tokens=24)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        record_demos(make_repo_tasks(1, seed=2), workflow, tok)


def test_the_recipe_accepts_a_warm_start_on_embedded_tasks_and_refuses_it_on_a_task_set(tmp_path, capsys):
    assert cli.main(["train", str(RECIPE), "--check", "warmstart.steps=3"]) == 0
    capsys.readouterr()
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("")
    code = cli.main(["train", str(RECIPE), "--check", "warmstart.steps=3", f"task.jsonl={jsonl}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("config error: warmstart.steps: "), err


# ---- the warm start on demonstrations, judged by greedy episodes through transformers (no vLLM) ----
_ONE_BASH_BLOCK = re.compile(r"```bash[ \t]*\n(.*?)\n```", re.DOTALL)


class GreedyHF:
    """The rollout client's ``generate`` as transformers' greedy decoding; keeps every turn's text."""

    def __init__(self, lm, tok):
        self.lm, self.tok, self.texts = lm, tok, []

    async def generate(self, input_ids, *, max_tokens, stop_token_ids, n=1, **_):
        with torch.no_grad():
            out = self.lm.generate(torch.tensor([input_ids]), max_new_tokens=max_tokens, do_sample=False,
                                   eos_token_id=list(stop_token_ids), pad_token_id=stop_token_ids[0])  # fmt: skip
        ids = out[0, len(input_ids) :].tolist()
        self.texts.append(self.tok.decode(ids, skip_special_tokens=True))
        sample = GenerationSample(ids, [0.0] * len(ids), [0] * len(ids), "stop")
        return GenerationResult("hf", list(input_ids), [sample])


def greedy_episodes(model_dir, tasks, workflow, mtp) -> tuple[float, list[dict]]:
    """(fraction of model turns with exactly one non-empty ```bash block, per-episode stats)."""
    from transformers import AutoTokenizer

    from areal_npu.agent.shell_agent import ShellAgent
    from areal_npu.model.layout import load_for_training

    tok = AutoTokenizer.from_pretrained(model_dir)
    lm, _, _ = load_for_training(model_dir, mtp)
    client, agent = GreedyHF(lm.eval(), tok), ShellAgent(workflow, tok)

    async def run_all():
        return [await agent.episode(t, client, agent.prompt_ids(t), group_id=-1) for t in tasks]

    try:
        trajs = asyncio.run(run_all())
    finally:
        agent.pool.shutdown()
    blocks = [_ONE_BASH_BLOCK.findall(text) for text in client.texts]
    well_formed = sum(len(b) == 1 and bool(b[0].strip()) for b in blocks)
    return well_formed / len(client.texts), [t.meta["stats"] for t in trajs]


@pytest.mark.slow
@pytest.mark.skip(reason="not yet measured to pass: took over 10 min on a loaded 2-core machine; enable once its floor is measured (issue 16)")
def test_a_short_warm_start_on_demonstrations_makes_greedy_turns_well_formed(tmp_path, recipe):
    from rich.console import Console

    from areal_npu.model.tiny import save_tiny_model
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.warmstart import WarmStartConfig, warm_start

    init_distributed()
    torch.manual_seed(0)
    train, held_out = make_splits(recipe.task)
    held_out = held_out[:8]
    base = save_tiny_model(tmp_path / "base", recipe.model.tiny)
    before, _ = greedy_episodes(base, held_out, recipe.workflow, recipe.mtp)
    short = WarmStartConfig(steps=WARM_STEPS, batch_size=4, lr=4e-3, log_every=10)
    out = warm_start(base, train[:32], tmp_path / "warm", Console(quiet=True), cfg=short, train=recipe.train,
                     mtp=recipe.mtp, seed=0, workflow=recipe.workflow)  # fmt: skip
    after, stats = greedy_episodes(out, held_out, recipe.workflow, recipe.mtp)
    print(f"well-formed turns: {before:.2f} before, {after:.2f} after; "
          f"submitted {sum(s['submitted'] for s in stats):g}/{len(stats)}, solved {sum(s['reward'] for s in stats):g}")
    assert before <= 0.1
    assert after >= AFTER_FLOOR and after - before >= 0.5
