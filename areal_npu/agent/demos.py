"""Scripted demonstrations of the shell agent on the embedded repo tasks: the warm start's data.

The task generator knows each repository's planted bug (``task.meta["fix"]``: the broken module's
correct source), so a demonstration is written from it, the way a careful engineer would work::

    look     "Read the module first."           cat toolkit/seq.py
    fix      "Fix the buggy line."              sed -i 's/size - 1\\]/size]/' toolkit/seq.py
    test     "Run the visible tests."           python -m unittest discover -s tests
    submit   "The fix is done; submit it."      echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT

(with fewer turns the test turn goes first, then the look). A demonstration is *recorded* by running
the real :class:`~areal_npu.agent.shell_agent.ShellAgent` episode with :class:`ScriptedClient`, which
answers each generation request with the next written turn plus the end-of-turn token, as an
engine stopping on it would. So the prompt, the chat framing, the observations (the commands really
run in the jailed repository copy, :class:`~areal_npu.agent.environments.RepoEnv`) and the loss mask
(1 on the assistant's tokens, 0 on prompt and observations) are those of a rollout by construction.
Every recorded episode must run each written turn without a format error and get reward 1 from the
hidden tests; anything else is a bug here or in the task generator (:class:`DemoError`).

Only tasks whose ``meta`` carries the fix (the embedded ones, :mod:`areal_npu.agent.repo_tasks`) have
demonstrations; a JSONL task set has none.
"""

from __future__ import annotations

import asyncio
import difflib
import re
from dataclasses import replace

from areal_npu.agent import actions
from areal_npu.agent.repo_task import RepoTask
from areal_npu.config import ConfigError
from areal_npu.data.sample import TrainSample
from areal_npu.data.trajectory import Trajectory, training_sample
from areal_npu.rollout.client import GenerationResult, GenerationSample

TEST_COMMAND = "python -m unittest discover -s tests"
SUBMIT_COMMAND = f"echo {actions.SUBMIT_MARKER}"

# One fixed reasoning line per step, none ending like a command (a path before the fence would read
# as the end of a block to a small model).
LOOK, FIX, TEST, SUBMIT = ("Read the module first.", "Fix the buggy line.", "Run the visible tests.",
                           "The fix is done; submit it.")  # fmt: skip


class DemoError(AssertionError):
    """A demonstration that does not solve its task: a bug in this module or in the task generator."""


def has_demo(task) -> bool:
    return isinstance(task, RepoTask) and isinstance(task.meta.get("fix"), dict) and len(task.meta["fix"]) == 1


def _bre(text: str) -> str:
    """``text`` as a literal sed basic regular expression (``/`` delimiter)."""
    return re.sub(r"([\\/.*\[\]^$])", r"\\\1", text)


def _sed_replacement(text: str) -> str:
    return re.sub(r"([\\/&])", r"\\\1", text)


def _fragment(bad_line: str, good_line: str, source: str) -> tuple[str, str, bool]:
    """The smallest whole-word span of ``bad_line`` that differs from ``good_line`` and occurs once
    in ``source``, what replaces it, and whether it is unique: the common prefix and suffix of the
    two lines stay out (cut back to whitespace), then whole words are added, left and right in turn,
    until the span occurs once in ``source`` or is the whole line (then it is not unique)."""
    p = 0
    while p < min(len(bad_line), len(good_line)) and bad_line[p] == good_line[p]:
        p += 1
    s = 0
    while s < min(len(bad_line), len(good_line)) - p and bad_line[-1 - s] == good_line[-1 - s]:
        s += 1
    indent = len(bad_line) - len(bad_line.lstrip())
    start = max(bad_line.rfind(" ", 0, p) + 1, indent)
    end = bad_line.find(" ", len(bad_line) - s)  # the suffix is common: the same offset in both
    end = len(bad_line) if end < 0 else end
    left = True
    while source.count(bad_line[start:end]) != 1 and (start > indent or end < len(bad_line)):
        if (left and start > indent) or end == len(bad_line):
            start = max(bad_line.rfind(" ", indent, start - 1) + 1, indent)
        else:
            nxt = bad_line.find(" ", end + 1)
            end = len(bad_line) if nxt < 0 else nxt
        left = not left
    bad = bad_line[start:end]
    good = good_line[start : len(good_line) - (len(bad_line) - end)]
    return bad, good, source.count(bad) == 1


def fix_command(task: RepoTask) -> str:
    """One ``sed -i`` that turns the broken module into the reference fix (one line changed or one
    line restored, as in every embedded bug family); a line number addresses it only where its
    text is not unique in the file."""
    ((path, fixed),) = task.meta["fix"].items()
    broken = task.snapshot[path]
    old, new = broken.splitlines(), fixed.splitlines()
    ops = [op for op in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(ops) != 1:
        raise DemoError(f"task {task.task_id}: the fix changes {len(ops)} places; one is expected")
    tag, i1, i2, j1, j2 = ops[0]
    if tag == "replace" and i2 - i1 == 1 and j2 - j1 == 1:
        bad, good, unique = _fragment(old[i1], new[j1], broken)
        script = ("" if unique else str(i1 + 1)) + f"s/{_bre(bad)}/{_sed_replacement(good)}/"
    elif tag == "insert" and j2 - j1 == 1 and i1 > 0:
        anchor = old[i1 - 1].strip()
        address = f"/{_bre(anchor)}/" if sum(anchor in line for line in old) == 1 else str(i1)
        script = f"{address}a\\{new[j1].replace(chr(92), chr(92) * 2)}"
    else:
        raise DemoError(f"task {task.task_id}: unexpected fix shape {ops[0]}")
    if "'" in script:
        raise DemoError(f"task {task.task_id}: the sed script {script!r} has a single quote")
    return f"sed -i '{script}' {path}"


# how a turn is written for each harness that has demonstrations (workflow.shell.harness)
STYLES = {
    "shell": "{reason}\n```bash\n{command}\n```",  # areal_npu.agent.actions
    "mini_swe_agent": "THOUGHT: {reason}\n\n```mswea_bash_command\n{command}\n```",  # its swebench_backticks
}


def demo_turns(task: RepoTask, max_turns: int, harness: str = "shell") -> list[str]:
    """The assistant turns of ``task``'s demonstration, at most ``max_turns`` of them, in ``harness``'s
    action format."""
    if harness not in STYLES:
        raise ConfigError("warmstart.steps", f"demonstrations are written for the {' and '.join(STYLES)} "
                          f"harnesses, not {harness!r}")  # fmt: skip
    ((path, _),) = task.meta["fix"].items()
    turn = STYLES[harness].format
    turns = {
        "look": turn(reason=LOOK, command=f"cat {path}"),
        "fix": turn(reason=FIX, command=fix_command(task)),
        "test": turn(reason=TEST, command=TEST_COMMAND),
        "submit": turn(reason=SUBMIT, command=SUBMIT_COMMAND),
    }
    order = ["look", "fix", "test", "submit"]
    for drop in ("test", "look", "submit"):  # what goes first when the turn budget is smaller
        if len(order) > max_turns:
            order.remove(drop)
    return [turns[k] for k in order]


class ScriptedClient:
    """The rollout client's ``generate``, answering with written turns: each turn's tokens and the
    end-of-turn token (as an engine that stops on it returns them), log-prob 0, version 0."""

    def __init__(self, tokenizer, turns: list[str], end_of_turn_id: int | None):
        self.tokenizer, self.turns, self.end = tokenizer, list(turns), end_of_turn_id
        self.calls = 0

    async def generate(self, input_ids, *, max_tokens: int, n: int = 1, **_sampling) -> GenerationResult:
        if self.calls >= len(self.turns):
            raise DemoError(f"the episode asked for turn {self.calls + 1} of a {len(self.turns)}-turn demonstration")
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False) + ([self.end] if self.end is not None else [])
        if len(ids) > max_tokens:
            raise ConfigError("workflow.max_new_tokens", f"({max_tokens} tokens for this turn) is too small for "
                              f"the warm start's demonstration turn of {len(ids)} tokens: {text!r}")  # fmt: skip
        sample = GenerationSample(ids, [0.0] * len(ids), [0] * len(ids), "stop")
        return GenerationResult("demo", list(input_ids), [sample] * n)


async def _record(agent, task: RepoTask, turns: list[str]) -> Trajectory:
    client = ScriptedClient(agent.tokenizer, turns, agent.chat.end_of_turn_id)
    traj = await agent.episode(task, client, agent.prompt_ids(task), group_id=-1)
    stats = traj.meta["stats"]
    if traj.reward != 1.0 or stats["format_errors"] or client.calls != len(turns):
        raise DemoError(
            f"the demonstration of {task.task_id} ({task.meta.get('family')}) got reward {traj.reward} "
            f"({traj.meta['reason']}), {stats['format_errors']:g} format errors, ended by {traj.meta['end']} "
            f"after {client.calls}/{len(turns)} turns: {turns}"
        )
    return traj


def record_demos(tasks: list[RepoTask], workflow, tokenizer) -> list[Trajectory]:
    """One recorded demonstration episode per task, through the shell agent ``workflow`` configures."""
    from areal_npu.agent.shell_agent import ShellAgent

    missing = [t.task_id for t in tasks if not has_demo(t)]
    if missing:
        raise ConfigError("warmstart.steps", f"needs demonstrations, which only the embedded repo tasks have "
                          f"(no reference fix: {', '.join(missing[:3])})")  # fmt: skip
    agent = ShellAgent(replace(workflow, group_size=1), tokenizer)

    harness = workflow.shell.harness

    async def record_all():
        try:
            return await asyncio.gather(*(_record(agent, t, demo_turns(t, workflow.max_turns, harness)) for t in tasks))
        finally:
            await agent.aclose()

    try:
        return list(asyncio.run(record_all()))
    finally:
        agent.pool.shutdown(wait=True)


def demo_samples(tokenizer, tasks: list[RepoTask], workflow) -> list[TrainSample]:
    """SFT samples (``input_ids``, ``loss_mask`` on the assistant tokens) of the recorded demonstrations."""
    samples = []
    for traj in record_demos(tasks, workflow, tokenizer):
        for part in (*traj.segments, traj):  # a harness's rewritten history: segments of their own
            s = training_sample(part, 0.0)
            samples.append(TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask))
    return samples


class GreedyHFClient:
    """The rollout client's ``generate`` as transformers' greedy decoding of ``lm`` (no engine): the
    cheapest way to see what a warm-started checkpoint does. Keeps every turn's decoded text."""

    def __init__(self, lm, tokenizer):
        self.lm, self.tokenizer, self.texts = lm, tokenizer, []

    async def generate(self, input_ids, *, max_tokens: int, stop_token_ids, n: int = 1, **_sampling):
        import torch

        with torch.no_grad():
            out = self.lm.generate(torch.tensor([list(input_ids)]), max_new_tokens=max_tokens, do_sample=False,
                                   eos_token_id=list(stop_token_ids), pad_token_id=stop_token_ids[0])  # fmt: skip
        ids = out[0, len(input_ids) :].tolist()
        self.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        sample = GenerationSample(ids, [0.0] * len(ids), [0] * len(ids), "stop")
        return GenerationResult("greedy-hf", list(input_ids), [sample] * n)


def greedy_episodes(model_dir, tasks: list[RepoTask], workflow, mtp) -> tuple[list[str], list[Trajectory]]:
    """Greedy shell-agent episodes of the checkpoint ``model_dir`` on ``tasks`` (one at a time, in the
    jail, as rollouts run them): every model turn's text, in order, and the trajectories."""
    from transformers import AutoTokenizer

    from areal_npu.agent.shell_agent import ShellAgent
    from areal_npu.model.layout import load_for_training

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lm, _, _ = load_for_training(model_dir, mtp)
    client = GreedyHFClient(lm.eval(), tokenizer)
    agent = ShellAgent(replace(workflow, group_size=1), tokenizer)

    async def run_all():
        return [await agent.episode(t, client, agent.prompt_ids(t), group_id=-1) for t in tasks]

    try:
        return client.texts, asyncio.run(run_all())
    finally:
        agent.pool.shutdown(wait=True)
