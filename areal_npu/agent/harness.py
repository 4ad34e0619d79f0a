"""Agent harnesses that drive the model through the OpenAI-compatible gateway
(:mod:`areal_npu.agent.gateway`): ``workflow.shell.harness``.

- ``shell``: the built-in loop of :class:`~areal_npu.agent.shell_agent.ShellAgent` (token in, token out;
  no gateway);
- ``mini_swe_agent``: mini-swe-agent v2's ``DefaultAgent`` with its text-based or tool-calling LiteLLM
  model (:mod:`areal_npu.agent.mini_swe`);
- ``package.module:function``: a harness of your own (bring your own: ``examples/byo_harness.py``).

A harness is a function ``harness(ctx: HarnessContext) -> dict`` run in a thread of its own per episode.
It talks to the model at ``ctx.base_url`` with ``ctx.api_key`` (any OpenAI-chat client) and runs shell
commands in the episode's environment with ``ctx.execute(command) -> (output, exit code)`` (the task's
image, limits and isolation: :mod:`areal_npu.agent.env_backends`). It returns how the episode ended:
``{"exit_status": ..., "format_errors": int}``. Exit statuses map to the end reasons the metrics count
(:data:`END_REASONS`): ``Submitted`` -> submitted; ``RepeatedFormatError`` -> format_limit;
``LimitsExceeded`` / ``TimeExceeded`` -> turn_budget; a context overflow the gateway answered ->
token_budget; anything else (an exception) -> env_error. The reward is the grader's, from the
repository as the harness left it; what the harness submits as text is not read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_npu import names

# the built-in harnesses other than shell, by the same module:function path a user's harness takes
BUILTIN = {"mini_swe_agent": "areal_npu.agent.mini_swe:run_mini_swe_agent"}
END_REASONS = names.EPISODE_ENDS
_STATUS = {"Submitted": "submitted", "RepeatedFormatError": "format_limit", "LimitsExceeded": "turn_budget",
           "TimeExceeded": "turn_budget", "ContextWindowExceededError": "token_budget"}  # fmt: skip


@dataclass
class HarnessContext:
    problem_statement: str
    base_url: str  # OpenAI-compatible, ends in /v1
    api_key: str  # this episode's key
    model: str  # the model name to send (any is accepted)
    execute: Callable[[str], tuple[str, int]]  # one shell command in the episode's environment
    workdir: str  # where the repository is, as commands see it
    max_turns: int  # model calls at most
    config: dict[str, Any] = field(default_factory=dict)  # workflow.shell.harness_config


def end_reason(result: dict, context_exceeded: bool) -> str:
    """The metrics' end reason of a harness's result (``context_exceeded``: the gateway refused a call)."""
    if context_exceeded:
        return "token_budget"
    return _STATUS.get(str(result.get("exit_status", "")), "env_error")


def load(name: str) -> Callable[[HarnessContext], dict]:
    """The harness function ``name`` names (not ``shell``: that one is the workflow's own loop)."""
    module, sep, func = BUILTIN.get(name, name).partition(":")
    if not sep or not module or not func:
        raise ValueError(f"must be shell, {', '.join(BUILTIN)} or package.module:function; got {name!r}")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{name!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{name!r} is not callable")
    return fn
