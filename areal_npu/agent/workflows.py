"""Workflows: how one task becomes a group of trajectories (chosen by dotted path in the recipe).

A workflow talks to the rollout engines through the client in token ids only and returns
:class:`~areal_npu.data.trajectory.Trajectory` objects whose response tokens keep the engine's ids,
behaviour log-probs and weight versions. Rewards come from the sandbox (run in a thread, so the
event loop keeps feeding the engines).

- :class:`SingleTurn`: prompt -> answer -> reward; the group is ``n`` samples of one request.
- :class:`MultiTurn`: the answer is graded; on failure the environment's feedback is appended as
  tokens (``loss_mask`` 0, version -1) and the model answers again, up to ``max_turns``; the reward
  is the last answer's, discounted by ``turn_discount`` per extra turn.
- :class:`~areal_npu.agent.shell_agent.ShellAgent`: a multi-turn shell agent in a jailed repository
  (``RepoTask``s), rewarded by the hidden tests.

A workflow class may declare ``config_keys`` (the ``WorkflowConfig`` keys it reads besides ``path``,
``group_size``, ``temperature`` and ``top_p``): a recipe that sets any other key away from its
default is refused, so nothing is accepted and ignored. A static ``check_config(cfg)`` may refuse
what the workflow cannot run with, before any work starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
from dataclasses import dataclass, field

from areal_npu.agent.jail import backend
from areal_npu.agent.reward import reward_many
from areal_npu.agent.sandbox import SandboxLimits
from areal_npu.agent.shell_config import ShellAgentConfig
from areal_npu.agent.tasks import Task, format_prompt
from areal_npu.config import ConfigError
from areal_npu.data.trajectory import Trajectory


@dataclass
class WorkflowConfig:
    path: str = "areal_npu.agent.workflows.SingleTurn"
    group_size: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 2  # MultiTurn and ShellAgent: model turns per episode
    turn_discount: float = 0.5  # MultiTurn only: reward * discount ** (turns - 1)
    reward_workers: int = 2  # concurrent sandboxes per workflow call
    # SingleTurn / MultiTurn: what grades answers: auto = bwrap (the jail; refused at --check where it
    # cannot start) | process (the weaker process sandbox: only when named here)
    grader_jail: str = "auto"
    # ShellAgent: reward 0 for an episode whose kept diff adds exit hooks, os._exit, an exit at import or
    # output that mimics the test runner in non-test code (agent.suspicious; counted as reward/suspicious
    # either way). For command-run tests only: there the code under test runs inside the runner's process
    zero_suspicious_reward: bool = False
    shell: ShellAgentConfig = field(default_factory=ShellAgentConfig)  # ShellAgent only

    def validate(self) -> None:
        cls = workflow_class(self.path)  # imported now, so a typo stops the run before any work
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0 (RL samples; greedy has no exploration)")
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if not 0 < self.turn_discount <= 1:
            raise ValueError("turn_discount must be in (0, 1]")
        used = getattr(cls, "config_keys", None)
        if used is not None:
            default = WorkflowConfig()
            for f in dataclasses.fields(self):
                unread = f.name not in _COMMON_KEYS and f.name not in used
                if unread and getattr(self, f.name) != getattr(default, f.name):
                    reads = ", ".join(sorted(_COMMON_KEYS | used))
                    raise ConfigError(f.name, f"is not read by {self.path} (it reads {reads}); remove it")
        check = getattr(cls, "check_config", None)
        if check is not None:
            check(self)


_COMMON_KEYS = frozenset({"path", "group_size", "temperature", "top_p"})


def workflow_class(path: str) -> type:
    """The class a dotted ``module.Class`` path names; ValueError (starting with ``path``) if it
    cannot be imported or is not a workflow (a class with an async ``run(task, client, group_id)``)."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(
            f"path must be a dotted path like areal_npu.agent.workflows.SingleTurn, got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a user module can fail to import in any way
        why = f"cannot import {module_name!r} ({type(exc).__name__}: {exc})"
    else:
        cls = getattr(module, class_name, None)
        if cls is None:
            why = f"module {module_name!r} has no {class_name!r}"
        elif not inspect.isclass(cls) or not inspect.iscoroutinefunction(getattr(cls, "run", None)):
            why = "not a class with an async run(task, client, group_id)"
        else:
            return cls
    raise ValueError(f"path {path!r} does not name a workflow class: {why}")


def load_workflow(cfg: WorkflowConfig, tokenizer):
    return workflow_class(cfg.path)(cfg, tokenizer)


def check_grader(cfg: WorkflowConfig) -> None:
    """The grading sandbox starts here, or the weaker one is named (``grader_jail``)."""
    if cfg.grader_jail not in ("auto", "bwrap", "process"):
        raise ConfigError("grader_jail", f"must be auto, bwrap or process; got {cfg.grader_jail!r}")
    if cfg.grader_jail != "process":
        ok, why = backend("bwrap").available()
        if not ok:
            raise ConfigError("grader_jail", f"the bwrap jail cannot start here ({why}); set "
                              "workflow.grader_jail=process to grade in the weaker process sandbox")  # fmt: skip


class SingleTurn:
    config_keys = frozenset({"max_new_tokens", "reward_workers", "grader_jail"})
    check_config = staticmethod(check_grader)

    def __init__(self, cfg: WorkflowConfig, tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.stop_ids = [tokenizer.encode("\n", add_special_tokens=False)[0], tokenizer.eos_token_id]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def sample(self, client, input_ids: list[int], n: int):
        result = await client.generate(
            input_ids,
            max_tokens=self.cfg.max_new_tokens,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            stop_token_ids=self.stop_ids,
            n=n,
        )
        if result.failed:
            raise RuntimeError(f"generation failed after {result.attempts} attempts: {result.error}")
        return result.samples

    async def grade(self, tasks: list[Task], samples) -> list[tuple[float, str]]:
        texts = [self.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
        limits = SandboxLimits(jail=self.cfg.grader_jail)
        return await asyncio.to_thread(reward_many, tasks, texts, self.cfg.reward_workers, limits)

    async def run(self, task: Task, client, group_id: int) -> list[Trajectory]:
        prompt = self.encode(format_prompt(task))
        samples = await self.sample(client, prompt, self.cfg.group_size)
        graded = await self.grade([task] * len(samples), samples)
        return [
            Trajectory(
                prompt,
                list(s.output_ids),
                list(s.logprobs),
                list(s.versions),
                reward=r,
                group_id=group_id,
                finish_reason=s.finish_reason or "",
                meta={"reason": why, "family": task.family, "spec": s.spec},
            )
            for s, (r, why) in zip(samples, graded)
        ]


class MultiTurn(SingleTurn):
    """Retry with feedback: ``# f(<input>) should be <expected>\\nf(x)=`` after a failed answer."""

    config_keys = SingleTurn.config_keys | {"max_turns", "turn_discount"}

    def feedback(self, task: Task) -> str:
        x, y = task.examples[0]
        return f"# f({x!r}) should be {y!r}\nf(x)="

    async def episode(self, task: Task, client, prompt: list[int], group_id: int) -> Trajectory:
        response: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        reward, reason, turns = 0.0, "no_program", 0
        for turn in range(self.cfg.max_turns):
            turns = turn + 1
            (sample,) = await self.sample(client, prompt + response, 1)
            response += sample.output_ids
            logprobs += sample.logprobs
            versions += sample.versions
            mask += [1] * len(sample.output_ids)
            ((reward, reason),) = await self.grade([task], [sample])
            if reward >= 1.0 or turn == self.cfg.max_turns - 1:
                break
            env = self.encode(self.feedback(task))
            response += env
            logprobs += [0.0] * len(env)
            versions += [-1] * len(env)
            mask += [0] * len(env)
        return Trajectory(
            prompt,
            response,
            logprobs,
            versions,
            reward=reward * self.cfg.turn_discount ** (turns - 1),
            loss_mask=mask,
            group_id=group_id,
            meta={"reason": reason, "turns": turns, "family": task.family},
        )

    async def run(self, task: Task, client, group_id: int) -> list[Trajectory]:
        prompt = self.encode(format_prompt(task))
        return list(
            await asyncio.gather(
                *(self.episode(task, client, prompt, group_id) for _ in range(self.cfg.group_size))
            )
        )
