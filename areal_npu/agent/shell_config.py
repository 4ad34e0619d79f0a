"""The shell agent's own settings (``workflow.shell``): budgets, observations and its jail.

Apart from :mod:`areal_npu.agent.shell_agent` because the workflow config holds them
(``WorkflowConfig.shell``) and the agent reads the workflow config: both import this module, and
only the agent imports the workflows, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_npu.agent.environments import EnvLimits
from areal_npu.agent.jail import JailLimits, backend
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
    jail: str = "bwrap"  # the jail each command and the grading run in
    command_timeout_s: float = 30.0  # wall-clock and CPU seconds of one command (its whole process tree)
    episode_seconds: float = 600.0  # wall clock of all of an episode's commands together
    repo_disk_mib: int = 1024  # disk the episode's repository copy may grow to; a command past it is killed
    env_workers: int = 2  # jailed commands and gradings that run at the same time (per workflow)

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
        backend(self.jail)  # ConfigError("jail", ...) naming the known backends

    def env_limits(self) -> EnvLimits:
        t = self.command_timeout_s
        return EnvLimits(
            command=JailLimits(wall_seconds=t, cpu_seconds=t, disk_bytes=self.repo_disk_mib << 20),
            episode_seconds=self.episode_seconds,
        )
