"""The multi-turn shell agent (mini-SWE-agent style) on repository tasks, token in, token out.

One episode of a :class:`~areal_npu.agent.environments.RepoTask`::

    prompt   = chat(system prompt, task message) + generation prompt        (loss 0)
    repeat   model turn: reasoning + one ```bash block (engine tokens)     (loss 1, version, log-prob)
             the command runs in the episode's jailed repository copy (RepoEnv)
             observation turn: exit code + output (rendered by the chat template, tokenised once)
                                                                             (loss 0, version -1)
    until    the agent submits (:data:`~areal_npu.agent.actions.SUBMIT_MARKER`), ``max_turns`` model
             turns, or the token budget ``shell.max_tokens`` (prompt + every turn) runs out
    reward   the hidden tests (``RepoEnv.grade``) on the repository as the episode left it

Conventions (prompts, action format, submission) are in :mod:`areal_npu.agent.actions`; how
observation turns become tokens in :mod:`areal_npu.agent.chat_format`. Token budget: every model
turn may generate ``workflow.max_new_tokens`` tokens, so an observation is appended only with room
for one more full answer; a command output that does not fit is cut (head and tail kept, with a
note); when not even the observation's frame fits, the episode ends. A malformed turn (no, two or
more, or an empty bash block) gets a format error as its observation and the episode goes on.

Per-episode numbers (turns, tokens, submitted, tests passed / pass rate, format errors, truncated
observations, which budget ended it) are in each trajectory's ``meta["stats"]`` (floats); the
grade's reason is ``meta["reason"]``. Environment work (reset, commands, grading) runs in a thread
pool of ``shell.env_workers`` threads, so the event loop keeps feeding the engines.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from areal_npu.agent import actions, env_backends, harness
from areal_npu.agent.chat_format import ChatFormat
from areal_npu.agent.environments import RepoEnv, area_sizes, make_base
from areal_npu.agent.gateway import MODEL_NAME, EpisodeSession, Gateway, segments
from areal_npu.agent.repo_task import RepoTask
from areal_npu.agent.warm_pool import WarmPool
from areal_npu.agent.workflows import WorkflowConfig
from areal_npu.config import ConfigError
from areal_npu.data.trajectory import Trajectory

_OUTPUT = "<<areal-npu command output 9b2e>>"  # where the output goes in an observation's text
BUDGET_NOTE = "\n[... output cut to fit the episode's token budget ...]\n"


logger = logging.getLogger(__name__)


@dataclass
class EpisodeStats:
    turns: int = 0  # model turns
    tokens: int = 0  # prompt + response (a harness episode: all its segments, a shared prefix once)
    model_tokens: int = 0
    submitted: int = 0
    format_errors: int = 0
    truncated_observations: int = 0  # cut to observation_chars or to the token budget
    turn_budget: int = 0  # 1: the episode ended at max_turns
    token_budget: int = 0  # 1: the episode ended at the token budget
    format_limit: int = 0  # 1: a harness ended it after repeated format errors
    env_error: int = 0  # 1: a harness ended it with an error of its own (its message is meta["error"])
    history_rewrites: int = 0  # harness calls that started a new segment other than by compaction
    compactions: int = 0  # harness calls that rewrote earlier messages into a shorter prompt (new segments)
    tests_passed: int = 0
    tests_total: int = 0
    pass_rate: float = 0.0
    reward: float = 0.0
    env_start_s: float = 0.0  # how long the episode waited for its environment (names.LATENCY_STATS)
    grade_s: float = 0.0  # how long its grading took
    suspicious: int = 0  # 1: its diff looks like it forges the runner's verdict (names.SUSPICIOUS_STAT)
    limits_cgroup: int = 0  # 1: every command ran in a control group (names.LIMIT_STATS)
    limits_disk_area: int = 0  # 1: every command's repository copy was a size-capped area

    def as_floats(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


class _PooledEnv:
    """A RepoEnv whose blocking calls run in the pool; closed after a command still running ends."""

    def __init__(self, env: RepoEnv, pool: ThreadPoolExecutor):
        self.env, self.pool = env, pool
        self.pending: Future | None = None

    async def call(self, fn, *args):
        self.pending = self.pool.submit(fn, *args)
        result = await asyncio.wrap_future(self.pending)
        self.pending = None
        return result

    def close_soon(self) -> None:
        """Remove the copy now, or (cancelled mid-command) once that command has ended."""
        if self.pending is None:
            self.env.close()
        else:
            self.pending.add_done_callback(lambda _: self.env.close())  # runs at once when done


class ShellAgent:
    """``workflow.path: areal_npu.agent.shell_agent.ShellAgent``; tasks are ``RepoTask``s."""

    #: WorkflowConfig keys this workflow reads besides path, group_size, temperature and top_p
    config_keys = frozenset({"max_new_tokens", "max_turns", "shell", "zero_suspicious_reward"})

    @staticmethod
    def check_config(cfg: WorkflowConfig) -> None:
        if cfg.shell.max_tokens <= cfg.max_new_tokens:
            raise ConfigError("shell.max_tokens", f"({cfg.shell.max_tokens}) leaves no room for a prompt "
                              f"besides one turn of max_new_tokens ({cfg.max_new_tokens})")  # fmt: skip
        # a ConfigError naming every reason when nothing allowed starts; its key is relative to the
        # workflow's, as the config tree prefixes it (the workflow sits at ``workflow`` in a recipe)
        backend = env_backends.resolve(cfg.shell.env, "shell.env", fallback_key=f"{env_backends.KEY}.fallback")
        env_backends.check_cgroup(cfg.shell.env, backend, "shell.env")

    def __init__(self, cfg: WorkflowConfig, tokenizer):
        self.cfg, self.shell = cfg, cfg.shell
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer, self.shell.observation_role)
        self.limits = self.shell.env_limits()
        self.pool = ThreadPoolExecutor(self.shell.env_workers, thread_name_prefix="shell-agent-env")
        self.backend = env_backends.resolve(self.shell.env)
        self.warm = WarmPool(lambda task, dest: make_base(task, dest, self.backend), self.shell.env_workers,
                             area=area_sizes(self.limits.command))  # fmt: skip
        self.harness = None if self.shell.harness == "shell" else harness.load(self.shell.harness)
        self.gateway: Gateway | None = None  # started on the first harness episode (it needs the loop)
        self._gateway_lock = asyncio.Lock()

    def close(self) -> None:
        self.warm.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        self.close()

    def encode(self, text: str) -> list[int]:
        return self.chat.encode(text)

    def prompt_ids(self, task: RepoTask) -> list[int]:
        system = self.shell.system_prompt or actions.SYSTEM_PROMPT
        return self.encode(
            self.chat.prompt_text(system, actions.TASK_PROMPT.format(problem=task.problem_statement))
        )

    async def run(self, task: RepoTask, client, group_id: int) -> list[Trajectory]:
        prompt = self.prompt_ids(task)
        self.warm.prefetch(task, min(self.shell.env.warm, self.cfg.group_size))
        results = await asyncio.gather(
            *(self.episode(task, client, prompt, group_id) for _ in range(self.cfg.group_size)),
            return_exceptions=True,
        )
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                raise RuntimeError(
                    f"episode {i} of task {task.task_id!r} failed: {type(r).__name__}: {r}"
                ) from r
        return list(results)

    async def eval_episode(self, task: RepoTask, client) -> dict[str, float]:
        """One episode under the weights the engines serve now: its stats (``reward`` among them)."""
        traj = await self.episode(task, client, self.prompt_ids(task), group_id=-1)
        return dict(traj.meta["stats"])

    def _score(self, stats: EpisodeStats, grade, env: RepoEnv) -> float:
        """Fill ``stats`` from the grade; the episode's reward (0 for a suspicious diff when
        ``workflow.zero_suspicious_reward`` is set)."""
        details = grade.details
        stats.tests_passed, stats.tests_total = int(details.get("passed", 0)), int(details.get("total", 0))
        stats.pass_rate = stats.tests_passed / stats.tests_total if stats.tests_total else grade.reward
        stats.suspicious = int(bool(details.get("suspicious")))
        stats.reward = 0.0 if stats.suspicious and self.cfg.zero_suspicious_reward else grade.reward
        stats.env_start_s, stats.grade_s = env.start_seconds, float(details.get("grade_seconds", 0.0))
        held = env.limits_held()
        stats.limits_cgroup, stats.limits_disk_area = held["cgroup"], held["disk_area"]
        return stats.reward

    async def _generate(self, client, input_ids: list[int], max_tokens: int):
        result = await client.generate(input_ids, max_tokens=max_tokens, temperature=self.cfg.temperature,
                                       top_p=self.cfg.top_p, stop_token_ids=self.chat.stop_ids, n=1)  # fmt: skip
        if result.failed:
            raise RuntimeError(f"generation failed after {result.attempts} attempts: {result.error}")
        return result.samples[0]

    def _observation_ids(
        self, content: str, output: str, model_ended_turn: bool, room: int
    ) -> tuple[list[int], bool] | None:
        """Tokens of one observation turn within ``room`` tokens (the output cut in the middle when
        needed); ``(ids, whether the output was cut)``, or None when even an empty output does not fit."""
        text = self.chat.observation_text(content, model_ended_turn)
        before, _, after = text.partition(_OUTPUT)
        # the output as plain text: a special token it spells (<|im_start|>) must not become one
        pre, out, post = self.encode(before), self.chat.encode_plain(output), self.encode(after)
        if len(pre) + len(out) + len(post) <= room:
            return pre + out + post, False
        note = self.encode(BUDGET_NOTE)
        keep = room - len(pre) - len(post) - len(note)
        if keep < 0:
            return None
        head = keep // 2
        tail = out[len(out) - (keep - head) :] if keep > head else []
        return pre + out[:head] + note + tail + post, True

    async def episode(self, task: RepoTask, client, prompt: list[int], group_id: int) -> Trajectory:
        if self.harness is not None:
            return await self.harness_episode(task, client, prompt, group_id)
        cfg, stats = self.cfg, EpisodeStats()
        if len(prompt) + 1 > self.shell.max_tokens:
            raise ValueError(f"the prompt of task {task.task_id!r} has {len(prompt)} tokens, no room in "
                             f"shell.max_tokens={self.shell.max_tokens}")  # fmt: skip
        response: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        env = _PooledEnv(RepoEnv(task, self.limits, self.backend, self.warm), self.pool)
        end = "turn_budget"
        try:
            await env.call(env.env.reset)
            for turn in range(cfg.max_turns):
                room = self.shell.max_tokens - len(prompt) - len(response)
                sample = await self._generate(client, prompt + response, min(cfg.max_new_tokens, room))
                out_ids = list(sample.output_ids)
                response += out_ids
                logprobs += list(sample.logprobs)
                versions += list(sample.versions)
                mask += [1] * len(out_ids)
                stats.turns += 1
                action = actions.parse_action(self.tokenizer.decode(out_ids, skip_special_tokens=True))
                output, cut = "", False
                if action.command is None:
                    stats.format_errors += 1
                    content = actions.format_error(action)
                else:  # runs even when no observation follows: its edits count at grading
                    output, code = await env.call(env.env.run, action.command)
                    if actions.is_submission(output):
                        stats.submitted, end = 1, "submitted"
                        break
                    output, cut = actions.cut_middle(output, self.shell.observation_chars)
                    content = actions.OBSERVATION.format(code=code, output=_OUTPUT)
                if turn == cfg.max_turns - 1:
                    break
                if len(out_ids) >= room:  # the budget cut this turn short
                    end = "token_budget"
                    break
                ended_turn = bool(out_ids) and out_ids[-1] == self.chat.end_of_turn_id
                room = self.shell.max_tokens - len(prompt) - len(response) - cfg.max_new_tokens
                observed = self._observation_ids(content, output, ended_turn, room)
                if observed is None:
                    end = "token_budget"
                    break
                obs_ids, budget_cut = observed
                stats.truncated_observations += int(cut or budget_cut)
                response += obs_ids
                logprobs += [0.0] * len(obs_ids)
                versions += [-1] * len(obs_ids)
                mask += [0] * len(obs_ids)
            grade = await env.call(env.env.grade)
            await env.call(env.env.close)
        finally:
            env.close_soon()
        stats.turn_budget, stats.token_budget = int(end == "turn_budget"), int(end == "token_budget")
        stats.tokens, stats.model_tokens = len(prompt) + len(response), sum(mask)
        reward = self._score(stats, grade, env.env)
        return Trajectory(prompt, response, logprobs, versions, reward=reward, loss_mask=mask,
                          group_id=group_id, finish_reason=end,
                          meta={"reason": grade.details.get("reason", "unknown"), "task_id": task.task_id,
                                "family": task.meta.get("family", ""), "end": end,
                                "env_backend": self.backend.name,
                                "stats": stats.as_floats()})  # fmt: skip

    async def harness_episode(self, task: RepoTask, client, prompt: list[int], group_id: int) -> Trajectory:
        """One episode driven by ``shell.harness`` in a thread, through the gateway (one key per episode);
        the trajectory is built from the gateway's records (:func:`~areal_npu.agent.gateway.segments`)."""
        if self.gateway is None:  # the first episodes of a group start together: one of them starts it
            async with self._gateway_lock:
                if self.gateway is None:
                    gateway = Gateway()
                    await gateway.start()
                    self.gateway = gateway  # published once it listens

        async def generate(ids: list[int], max_tokens: int):
            return await self._generate(client, ids, max_tokens)

        session = self.gateway.open(EpisodeSession(self.chat, generate, self.shell.max_tokens, self.cfg.max_new_tokens,
                                                   self.shell.tool_parser))  # fmt: skip
        env = _PooledEnv(RepoEnv(task, self.limits, self.backend, self.warm), self.pool)
        cuts = []

        def execute(command: str) -> tuple[str, int]:  # in the harness's thread
            output, code = env.env.run(command)
            output, cut = actions.cut_middle(output, self.shell.observation_chars)
            cuts.append(cut)
            return output, code

        try:
            await env.call(env.env.reset)
            ctx = harness.HarnessContext(task.problem_statement, self.gateway.base_url, session.key, MODEL_NAME,
                                         execute, task.workdir, self.cfg.max_turns, dict(self.shell.harness_config))  # fmt: skip
            result = await asyncio.to_thread(self.harness, ctx)
            grade = await env.call(env.env.grade)
            await env.call(env.env.close)
        finally:
            self.gateway.close(session)
            env.close_soon()
        end = harness.end_reason(result, session.end_reason == "context")
        stats = EpisodeStats(turns=len(session.calls), format_errors=int(result.get("format_errors", 0)),
                             truncated_observations=sum(cuts), submitted=int(end == "submitted"),
                             turn_budget=int(end == "turn_budget"), token_budget=int(end == "token_budget"),
                             format_limit=int(end == "format_limit"), env_error=int(end == "env_error"),
                             history_rewrites=sum(not (c.continues or c.compacted) for c in session.calls[1:]),
                             compactions=sum(c.compacted for c in session.calls))  # fmt: skip
        stats.tokens = session.tokens if session.calls else len(prompt)  # what the budget counted
        stats.model_tokens = sum(len(c.output_ids) for c in session.calls)
        reward = self._score(stats, grade, env.env)
        parts = [Trajectory(s.prompt_ids, s.response_ids, s.logprobs, s.versions, reward=reward,
                            loss_mask=s.mask, group_id=group_id, finish_reason=end)
                 for s in segments(session.calls)] or [Trajectory(prompt, [], [], [], reward=reward,
                                                                  group_id=group_id, finish_reason=end)]  # fmt: skip
        meta = {"reason": grade.details.get("reason", "unknown"), "task_id": task.task_id, "end": end,
                "env_backend": self.backend.name, "harness": self.shell.harness, "stats": stats.as_floats()}  # fmt: skip
        if end == "env_error":
            meta["error"] = str(result.get("error") or result.get("exit_status", ""))[:500]
            logger.warning("harness %s ended an episode of %s with an error: %s", self.shell.harness, task.task_id,
                           meta["error"])  # fmt: skip
        main = parts[-1]
        main.meta, main.segments = meta, parts[:-1]
        return main
