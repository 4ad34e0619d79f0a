"""mini-swe-agent v2 as a harness (``workflow.shell.harness: mini_swe_agent``).

Its ``DefaultAgent`` loop and one of its LiteLLM models run unchanged against the gateway:
``model.model_class: litellm_textbased`` (the default: one ```` ```mswea_bash_command ```` block a
turn, its ``swebench_backticks.yaml``) or ``litellm`` (tool calling: its ``bash`` tool, parsed back by
the gateway; its ``swebench.yaml``). Commands run in the
episode's environment through :class:`ProjectEnvironment` (its own bubblewrap environment cannot put a
task image at ``/``, so the project's backends stand in). Its submission protocol is kept: a command
whose output starts with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` ends the episode.

Configuration: that model class's SWE-bench config of mini-swe-agent (its prompts), with
``workflow.shell.harness_config`` merged over it (``agent:`` templates and limits, ``model:``
observation / format-error templates; the recipe's own overrides). What the RL loop owns is set last:
the model endpoint (the gateway), ``step_limit`` (``workflow.max_turns``), no cost limit.
"""

from __future__ import annotations

import os

# model_class -> mini-swe-agent's SWE-bench config written for it
BASE_CONFIGS = {"litellm_textbased": "swebench_backticks.yaml", "litellm": "swebench.yaml"}
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class ProjectEnvironment:
    """mini-swe-agent's Environment protocol over ``ctx.execute`` (``ctx``: an
    :class:`areal_npu.agent.harness.HarnessContext`, which calls this module by its path only)."""

    def __init__(self, ctx, **config):
        self.ctx = ctx
        self.config = {"cwd": ctx.workdir, **config}

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        from minisweagent.exceptions import Submitted

        output, code = self.ctx.execute(action.get("command", ""))
        lines = output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and code == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})  # fmt: skip
        return {"output": output, "returncode": code, "exception_info": ""}

    def get_template_vars(self, **kwargs) -> dict:
        return {**self.config, **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config, "environment_type": type(self).__name__}}}


def model_class(overrides: dict) -> str:
    """The model class ``overrides`` (``harness_config``) pick: ``model.model_class``."""
    name = (overrides.get("model") or {}).get("model_class") or "litellm_textbased"
    if name not in BASE_CONFIGS:
        raise ValueError(f"model.model_class must be one of {', '.join(BASE_CONFIGS)}; got {name!r}")
    return name


def build_config(overrides: dict) -> dict:
    """mini-swe-agent's SWE-bench config for the model class with ``overrides`` merged in (its own merge)."""
    import yaml
    from minisweagent.config import get_config_path
    from minisweagent.utils.serialize import recursive_merge

    base = yaml.safe_load(get_config_path(BASE_CONFIGS[model_class(overrides)]).read_text())
    return recursive_merge(base, overrides)


def run_mini_swe_agent(ctx) -> dict:
    """The harness: one mini-swe-agent episode on ``ctx`` (a HarnessContext); its result dict."""
    # LiteLLM would fetch a price map from the internet; a failed call is not retried for minutes
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models import get_model_class

    litellm.suppress_debug_info = True  # its "Provider List" banner on every refused call
    cfg = build_config(ctx.config)
    model_cls = get_model_class("", model_class(ctx.config))
    owned = ("model_name", "model_kwargs", "model_class")
    model_cfg = {k: v for k, v in cfg.get("model", {}).items() if k not in owned}
    model = model_cls(
        **model_cfg, model_name=f"hosted_vllm/{ctx.model}", cost_tracking="ignore_errors",
        model_kwargs={"api_base": ctx.base_url, "api_key": ctx.api_key, "drop_params": True},
    )  # fmt: skip
    env_cfg = {k: v for k, v in cfg.get("environment", {}).items() if k == "env"}
    agent_cfg = {**cfg.get("agent", {}), "step_limit": ctx.max_turns, "cost_limit": 0.0, "output_path": None}
    agent = DefaultAgent(model, ProjectEnvironment(ctx, **env_cfg), **agent_cfg)
    try:
        result = agent.run(task=ctx.problem_statement)
    except Exception as exc:  # noqa: BLE001 - the agent's own uncaught errors end the episode, recorded
        result = {"exit_status": type(exc).__name__, "error": str(exc)[:500]}
    format_errors = sum(1 for m in agent.messages if m.get("extra", {}).get("interrupt_type") == "FormatError")
    return {**result, "format_errors": format_errors, "turns": agent.n_calls}
