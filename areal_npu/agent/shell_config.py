"""The shell agent's own settings (``workflow.shell``): budgets, observations and its jail.

Apart from :mod:`areal_npu.agent.shell_agent` because the workflow config holds them
(``WorkflowConfig.shell``) and the agent reads the workflow config: both import this module, and
only the agent imports the workflows, never the reverse.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from areal_npu.agent.env_backends import EnvConfig
from areal_npu.agent.environments import EnvLimits
from areal_npu.agent.jail import JailLimits
from areal_npu.config import ConfigError

OBSERVATION_ROLES = ("user", "tool")


@dataclass
class ShellAgentConfig:
    """the shell agent (workflow.path areal_npu.agent.shell_agent.ShellAgent): budgets and its jail"""

    max_tokens: int = 65536  # token budget of one episode: prompt, model turns and observations together
    observation_chars: int = 10000  # command output longer than this is cut to its head and tail with a note
    observation_role: str = "user"  # chat role of observation turns: user (mini-SWE-agent) | tool
    # the system message; empty: the built-in one (areal_npu.agent.actions.SYSTEM_PROMPT)
    system_prompt: str = ""
    env: EnvConfig = field(default_factory=EnvConfig)  # where each command and the grading run
    command_timeout_s: float = 30.0  # wall-clock and CPU seconds of one command (its whole process tree)
    episode_seconds: float = 600.0  # wall clock of all of an episode's commands together
    repo_disk_mib: int = 1024  # disk the episode's repository copy may grow to; a command past it is killed
    env_workers: int = 2  # jailed commands and gradings that run at the same time (per workflow)
    # who drives the model: shell (the built-in loop) | mini_swe_agent (mini-swe-agent v2 through the
    # OpenAI-compatible gateway) | package.module:function (your own harness; areal_npu.agent.harness)
    harness: str = "shell"
    # merged over the harness's own config (mini_swe_agent: its SWE-bench config: agent / model keys;
    # model.model_class: litellm_textbased (a fenced command a turn) | litellm (its bash tool, tool calls))
    harness_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's tool parser (--tool-call-parser) that reads a harness's tool calls back from the sampled text:
    # qwen3_coder (Qwen3.5/3.6) | hermes (Qwen2.5/Qwen3 JSON calls) | any other name vLLM registers
    tool_parser: str = "qwen3_coder"

    def validate(self) -> None:
        for key in ("max_tokens", "observation_chars", "env_workers", "repo_disk_mib"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1; got {getattr(self, key)}")
        if self.observation_chars < 200:
            raise ConfigError(
                "observation_chars",
                f"must be >= 200 (room for a head, a tail and the note); got {self.observation_chars}",
            )
        if self.observation_role not in OBSERVATION_ROLES:
            raise ConfigError(
                "observation_role",
                f"must be one of {', '.join(OBSERVATION_ROLES)}; got {self.observation_role!r}",
            )
        for key in ("command_timeout_s", "episode_seconds"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be > 0; got {getattr(self, key)}")
        self.env.validate()
        if self.harness != "shell":
            from areal_npu.agent import harness

            try:
                harness.load(self.harness)
            except ValueError as exc:
                raise ConfigError("harness", str(exc)) from None
            if self.system_prompt:
                raise ConfigError("system_prompt", "is the shell harness's; set the harness's own prompts "
                                  "in harness_config")  # fmt: skip
            self._check_tool_parser()
            if self.harness == "mini_swe_agent":
                from areal_npu.agent import mini_swe

                try:
                    mini_swe.model_class(self.harness_config)
                except ValueError as exc:
                    raise ConfigError("harness_config", str(exc)) from None
        elif self.harness_config:
            raise ConfigError("harness_config", "is read by a harness other than shell")
        elif self.tool_parser != type(self).tool_parser:
            raise ConfigError("tool_parser", "parses a gateway harness's tool calls; the shell harness "
                              "reads fenced commands")  # fmt: skip

    def _check_tool_parser(self) -> None:
        from areal_npu.agent import tool_calls

        try:
            known = tool_calls.parser_names()
        except ImportError:  # no vLLM here: the gateway names the problem at the first request with tools
            return
        if self.tool_parser not in known:
            close = difflib.get_close_matches(self.tool_parser, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError("tool_parser", f"vLLM has no tool parser {self.tool_parser!r}; {hint}"
                              f"known: {', '.join(known)}")  # fmt: skip

    def env_limits(self) -> EnvLimits:
        t = self.command_timeout_s
        return EnvLimits(
            command=JailLimits(wall_seconds=t, cpu_seconds=t, disk_bytes=self.repo_disk_mib << 20),
            episode_seconds=self.episode_seconds,
        )
