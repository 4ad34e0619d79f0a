"""Workflows against a scripted client: token ids, log-probs and versions pass through untouched,
rewards come from the sandbox, environment turns carry no loss."""

import asyncio

import pytest

from areal_npu.agent.tasks import format_prompt, make_dataset
from areal_npu.agent.workflows import MultiTurn, SingleTurn, WorkflowConfig, load_workflow
from areal_npu.model.tiny import build_tokenizer
from areal_npu.rollout.client import GenerationResult, GenerationSample


class ScriptedClient:
    """Answers each request with the next scripted texts; records what it was asked."""

    def __init__(self, tokenizer, answers, version=3):
        self.tokenizer = tokenizer
        self.answers = list(answers)
        self.version = version
        self.requests = []

    async def generate(self, input_ids, n=1, **kwargs):
        self.requests.append((list(input_ids), n, kwargs))
        samples = []
        for _ in range(n):
            ids = self.tokenizer.encode(self.answers.pop(0), add_special_tokens=False)
            samples.append(GenerationSample(ids, [-0.5 - 0.01 * i for i in range(len(ids))],
                                            [self.version] * len(ids), "stop"))
        return GenerationResult("r", list(input_ids), samples)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_single_turn_group(tokenizer):
    task = make_dataset(1, seed=4)[0]
    cfg = WorkflowConfig(group_size=3, max_new_tokens=12)
    client = ScriptedClient(tokenizer, [task.answer + "\n", "0\n", "(\n"])
    group = asyncio.run(SingleTurn(cfg, tokenizer).run(task, client, group_id=7))
    prompt = tokenizer.encode(format_prompt(task), add_special_tokens=False)
    assert client.requests[0][0] == prompt and client.requests[0][1] == 3
    assert client.requests[0][2]["max_tokens"] == 12
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    assert newline in client.requests[0][2]["stop_token_ids"]
    assert [t.group_id for t in group] == [7, 7, 7]
    assert group[0].response_ids == tokenizer.encode(task.answer + "\n", add_special_tokens=False)
    assert group[0].behave_logprobs[:2] == [-0.5, -0.51] and set(group[0].versions) == {3}
    assert group[0].reward == 1.0 and group[0].meta["reason"] == "ok"
    assert group[2].reward == 0.0 and group[2].meta["reason"] == "syntax_error"
    assert group[1].reward < 1.0


def test_multi_turn_feedback_tokens_carry_no_loss(tokenizer):
    task = make_dataset(1, seed=9)[0]
    cfg = WorkflowConfig(path="areal_npu.agent.workflows.MultiTurn", group_size=1, max_turns=2, turn_discount=0.5)
    client = ScriptedClient(tokenizer, ["(\n", task.answer + "\n"])
    wf = load_workflow(cfg, tokenizer)
    assert isinstance(wf, MultiTurn)
    (traj,) = asyncio.run(wf.run(task, client, group_id=0))
    first = tokenizer.encode("(\n", add_special_tokens=False)
    env = tokenizer.encode(wf.feedback(task), add_special_tokens=False)
    second = tokenizer.encode(task.answer + "\n", add_special_tokens=False)
    assert traj.response_ids == first + env + second
    assert traj.loss_mask == [1] * len(first) + [0] * len(env) + [1] * len(second)
    assert traj.versions == [3] * len(first) + [-1] * len(env) + [3] * len(second)
    assert traj.reward == 0.5 and traj.meta["turns"] == 2  # solved on the second turn, discounted once
    # the second request saw the whole conversation so far, as token ids
    assert client.requests[1][0] == traj.prompt_ids + first + env


def test_bad_workflow_path_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="does not name a workflow class"):
        load_workflow(WorkflowConfig(path="areal_npu.agent.workflows.Nope"), tokenizer)


def test_no_jail_is_refused_at_check_unless_the_weaker_sandbox_is_named(monkeypatch):
    # attack through the public API: with bubblewrap unable to start, grading must not slip into the
    # process sandbox (where an answer could read the host and forge its reward) unless chosen by name
    from areal_npu.agent import jail, sandbox
    from areal_npu.config import ConfigError

    monkeypatch.setattr(jail.BubblewrapJail, "available", lambda self: (False, "no user namespaces (faked)"))
    with pytest.raises(ConfigError, match="grader_jail"):
        WorkflowConfig(path="areal_npu.agent.workflows.SingleTurn").validate()
    WorkflowConfig(path="areal_npu.agent.workflows.SingleTurn", grader_jail="process").validate()
    assert sandbox.resolve_jail("auto") == ("unavailable", "no user namespaces (faked)")
    res = sandbox.run_tests("def f(x):\n    return x\n", [(1, 1)], sandbox.SandboxLimits(jail="auto"))
    assert res.reason == "sandbox_error" and res.passed == 0
