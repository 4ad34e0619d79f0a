"""The held-out eval with workflows whose episodes fail: a failed generation or grading is counted,
never raised into the training loop; the shell agent's episodes report their stats as eval/<name>."""

import asyncio
from types import SimpleNamespace

import pytest

from areal_npu import names
from areal_npu.agent.jail import backend
from areal_npu.agent.repo_tasks import make_repo_tasks
from areal_npu.agent.shell_config import ShellAgentConfig
from areal_npu.agent.tasks import make_dataset
from areal_npu.agent.workflows import WorkflowConfig, load_workflow
from areal_npu.algo.advantages import GRPOConfig
from areal_npu.controller import ControllerConfig, RLController
from areal_npu.model.tiny import build_tokenizer
from areal_npu.rollout.client import GenerationResult, GenerationSample
from areal_npu.speculation.config import SpecConfig
from areal_npu.train.losses import PPOLoss

JAIL_OK, JAIL_WHY = backend("bwrap").available()
SUBMIT = "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


class Logger:
    def __init__(self):
        self.lines = []

    def print(self, line):
        self.lines.append(line)


class Client:
    """Answers requests in order from ``answers``; None is a failed generation."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, list(answers)

    async def generate(self, input_ids, **kwargs):
        text = self.answers.pop(0)
        if text is None:
            return GenerationResult("r", list(input_ids), failed=True, error="engine 0: gone", attempts=3)
        ids = self.tok.encode(text, add_special_tokens=False)
        return GenerationResult(
            "r", list(input_ids), [GenerationSample(ids, [-0.1] * len(ids), [0] * len(ids), "stop")]
        )


def controller(tok, client, eval_tasks, tmp_path):
    return RLController(ControllerConfig(eval_size=len(eval_tasks)), SimpleNamespace(version=0), tok, client, eval_tasks,
                        tmp_path, Logger(), spec=SpecConfig(), grpo=GRPOConfig(), loss=PPOLoss(), seed=0,
                        eval_tasks=eval_tasks)  # fmt: skip


def test_single_turn_eval_counts_a_failed_generation_and_a_failed_grader(tmp_path):
    tok = build_tokenizer()
    tasks = make_dataset(3, seed=4)
    wf = load_workflow(WorkflowConfig(max_new_tokens=12), tok)
    c = controller(tok, Client(tok, [tasks[0].answer + "\n", None, "(\n"]), tasks, tmp_path)
    stats = asyncio.run(c.evaluate(wf))
    assert (
        stats[names.EVAL_FAILED] == 1 and stats[names.EVAL_REWARD] == 0.5 and stats[names.EVAL_SOLVED] == 0.5
    )
    assert "1 of 3" in c.logger.lines[0]

    async def broken_grade(tasks, samples):
        raise RuntimeError("sandbox gone")

    wf.grade = broken_grade
    c = controller(tok, Client(tok, ["1\n", "2\n", "3\n"]), tasks, tmp_path)
    stats = asyncio.run(c.evaluate(wf))
    assert stats[names.EVAL_FAILED] == 3 and names.EVAL_REWARD not in stats


@pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
def test_shell_agent_eval_episodes_log_their_stats_and_a_failure_is_counted(tmp_path):
    tok = build_tokenizer()
    tasks = make_repo_tasks(3, seed=5)
    cfg = WorkflowConfig(path="areal_npu.agent.shell_agent.ShellAgent", max_new_tokens=256, max_turns=4,
                         shell=ShellAgentConfig(max_tokens=8192))  # fmt: skip
    wf = load_workflow(cfg, tok)
    # episodes run concurrently: each takes answers in request order; one episode's second request fails
    c = controller(tok, Client(tok, ["```bash\nls\n```", SUBMIT, SUBMIT, None, SUBMIT]), tasks, tmp_path)
    stats = asyncio.run(c.evaluate(wf))
    assert stats[names.EVAL_FAILED] == 1
    assert stats[names.EVAL_REWARD] == 0.0 and stats["eval/submitted"] == 1.0
    assert 1 <= stats["eval/turns"] <= 2
