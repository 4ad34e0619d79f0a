"""Agent harnesses in the loop: mini-swe-agent v2 (unchanged, through LiteLLM and the gateway) and a
bring-your-own harness (the openai client), on a real jailed repo task, against a scripted engine.

References: the task's reference fix (reward 1 when the harness applied it, 0 when it did not), the
scripted engine's own outputs (the trained tokens and their log-probs are exactly what it sampled, in
order), mini-swe-agent's documented protocol (a reply it cannot parse is dropped from its history: a
new segment; three in a row end the episode), and a budget too small for the first prompt."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from areal_npu import names
from areal_npu.agent.jail import backend
from areal_npu.agent.repo_tasks import make_repo_tasks
from areal_npu.agent.shell_agent import ShellAgent
from areal_npu.agent.shell_config import ShellAgentConfig
from areal_npu.agent.workflows import WorkflowConfig, load_workflow
from areal_npu.config import ConfigError
from areal_npu.model.tiny import build_tokenizer
from tests.support.scripted_engine import ScriptedEngine

JAIL_OK, JAIL_WHY = backend("bwrap").available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def task():
    return make_repo_tasks(1, seed=3)[0]


def agent(tok, harness, **shell):
    cfg = WorkflowConfig(path="areal_npu.agent.shell_agent.ShellAgent", group_size=1, max_new_tokens=1024,
                         max_turns=6, shell=ShellAgentConfig(harness=harness, **{"max_tokens": 16384, **shell}))  # fmt: skip
    cfg.validate()
    wf = load_workflow(cfg, tok)
    assert isinstance(wf, ShellAgent)
    return wf


def episode(wf, task, engine):
    async def go():
        try:
            return (await wf.run(task, engine, group_id=3))[0]
        finally:
            await wf.aclose()

    return asyncio.run(go())


def mswea(command: str) -> str:
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


def fix(task) -> str:
    ((path, text),) = task.meta["fix"].items()
    return f"cat > {path} <<'EOF'\n{text}EOF"


def trained(traj):
    return [(t, lp) for s in (*traj.segments, traj) for t, lp, m in zip(s.response_ids, s.behave_logprobs, s.loss_mask) if m]


def test_mini_swe_agent_fixes_submits_and_trains_on_the_sampled_tokens(tok, task):
    engine = ScriptedEngine(tok, [mswea("ls"), "no action here", mswea(fix(task)),
                                  mswea("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])  # fmt: skip
    traj = episode(agent(tok, "mini_swe_agent"), task, engine)
    stats = traj.meta["stats"]
    assert traj.reward == 1.0 and traj.meta["end"] == "submitted" and stats["submitted"] == 1
    assert stats["turns"] == 4 and stats["format_errors"] == 1
    # the unparsable reply is left out of mini-swe-agent's history: the next call starts a new segment
    assert stats["history_rewrites"] == 1 and len(traj.segments) == 1
    assert trained(traj) == [(t, lp) for ids, lps, _ in engine.sent for t, lp in zip(ids, lps)]
    # within a segment every call's prompt is the previous call's tokens verbatim plus the observation
    prompts = [r["input_ids"] for r in engine.requests]
    assert prompts[3][: len(prompts[2]) + len(engine.sent[2][0])] == prompts[2] + engine.sent[2][0]
    assert "<returncode>0</returncode>" in tok.decode(prompts[3])  # mini-swe-agent's observation template


def test_repeated_format_errors_and_a_context_overflow_end_the_episode(tok, task):
    traj = episode(agent(tok, "mini_swe_agent"), task, ScriptedEngine(tok, ["a", "b", "c", "d"]))
    assert traj.meta["end"] == "format_limit" and traj.reward == 0.0 and traj.meta["stats"]["turns"] == 3
    small = agent(tok, "mini_swe_agent", max_tokens=1100)  # mini-swe-agent's prompts alone are longer
    engine = ScriptedEngine(tok, [mswea("ls")])
    traj = episode(small, task, engine)
    assert traj.meta["end"] == "token_budget" and engine.sent == [] and traj.response_ids == []


def load_example():
    """examples/byo_harness.py importable as ``byo_harness`` (as PYTHONPATH would make it)."""
    spec = importlib.util.spec_from_file_location("byo_harness", ROOT / "examples" / "byo_harness.py")
    sys.modules["byo_harness"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def test_bring_your_own_harness_example(tok, task):
    load_example()
    engine = ScriptedEngine(tok, [f"```bash\n{fix(task)}\n```", "```bash\necho DONE\n```"])
    traj = episode(agent(tok, "byo_harness:run"), task, engine)
    assert traj.reward == 1.0 and traj.meta["end"] == "submitted" and traj.segments == []
    assert trained(traj) == [(t, lp) for ids, lps, _ in engine.sent for t, lp in zip(ids, lps)]


@pytest.mark.parametrize(
    ("shell", "key"),
    [({"harness": "nope"}, "harness"), ({"harness": "mini_swe_agent", "system_prompt": "x"}, "system_prompt"),
     ({"harness_config": {"agent": {}}}, "harness_config")],  # fmt: skip
)
def test_bad_harness_settings_name_the_key(shell, key):
    with pytest.raises(ConfigError, match=key):
        ShellAgentConfig(**shell).validate()


def test_a_group_of_episodes_starts_one_gateway_together(tok, task):
    class Always(ScriptedEngine):
        async def generate(self, input_ids, *, max_tokens, n=1, **kwargs):
            self.turns.append("```bash\necho DONE\n```")
            return await super().generate(input_ids, max_tokens=max_tokens, n=n, **kwargs)

    load_example()
    cfg = WorkflowConfig(path="areal_npu.agent.shell_agent.ShellAgent", group_size=3, max_new_tokens=64,
                         max_turns=2, shell=ShellAgentConfig(max_tokens=4096, harness="byo_harness:run"))  # fmt: skip
    cfg.validate()
    wf = load_workflow(cfg, tok)

    async def go():
        try:
            return await wf.run(task, Always(tok, []), group_id=1)
        finally:
            await wf.aclose()

    group = asyncio.run(go())
    assert [t.meta["end"] for t in group] == ["submitted"] * 3  # none refused by a gateway not yet listening


def bash_call(command: str) -> str:  # Qwen3.5's tool-call format, read back by vLLM's qwen3_coder parser
    return f"THOUGHT: next.\n\n<tool_call>\n<function=bash>\n<parameter=command>\n{command}\n</parameter>\n</function>\n</tool_call>"


def test_mini_swe_agent_tool_calling_model(tok, task):
    submit = bash_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    engine = ScriptedEngine(tok, [bash_call(fix(task)), submit])
    wf = agent(tok, "mini_swe_agent", harness_config={"model": {"model_class": "litellm"}})
    traj = episode(wf, task, engine)
    assert traj.reward == 1.0 and traj.meta["end"] == "submitted" and traj.meta["stats"]["turns"] == 2
    # its bash tool's call ran, and its result came back as a tool turn continuing the same tokens
    assert traj.segments == [] and '"name": "bash"' in tok.decode(engine.requests[0]["input_ids"])
    first, second = (r["input_ids"] for r in engine.requests)
    out = engine.sent[0][0]
    assert second[: len(first) + len(out)] == first + out
    assert "<tool_response>\n<returncode>0</returncode>" in tok.decode(second[len(first) + len(out) :])
    assert trained(traj) == [(t, lp) for ids, lps, _ in engine.sent for t, lp in zip(ids, lps)]
    with pytest.raises(ConfigError, match="model_class"):
        ShellAgentConfig(harness="mini_swe_agent", harness_config={"model": {"model_class": "x"}}).validate()


def compacting_harness(ctx) -> dict:
    """Two turns, then its history summarised (the old turns dropped), then one more turn."""
    from openai import OpenAI

    client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    head = [{"role": "system", "content": "Fix the bug."}, {"role": "user", "content": ctx.problem_statement}]
    messages = list(head)
    for _ in range(2):
        reply = client.chat.completions.create(model=ctx.model, messages=messages).choices[0].message.content
        output, code = ctx.execute(reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"{code} {output}"}]
    messages = [*head, {"role": "user", "content": "Summary: you ran two commands."}]
    client.chat.completions.create(model=ctx.model, messages=messages)
    return {"exit_status": "Submitted", "format_errors": 0}


def test_a_compacting_harness_is_recorded_and_its_segments_count_in_the_budget(tok, task):
    sys.modules["compacting_harness"] = module = type(sys)("compacting_harness")
    module.run = compacting_harness
    engine = ScriptedEngine(tok, ["ls", "cat " + next(iter(task.meta["fix"])), "pwd"])
    traj = episode(agent(tok, "compacting_harness:run"), task, engine)
    stats = traj.meta["stats"]
    assert stats["compactions"] == 1 and stats["history_rewrites"] == 0 and len(traj.segments) == 1
    assert {"compactions", "history_rewrites"} == set(names.SEGMENT_STATS)
    (before,) = traj.segments
    old, new = before.prompt_ids + before.response_ids, traj.prompt_ids + traj.response_ids
    shared = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)  # system + task, counted once
    assert 0 < shared < len(traj.prompt_ids) and stats["tokens"] == len(old) + len(new) - shared
    assert trained(traj) == [(t, lp) for ids, lps, _ in engine.sent for t, lp in zip(ids, lps)]
