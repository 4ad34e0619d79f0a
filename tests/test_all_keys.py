"""Every key of the recipe schema, on every platform (the CPU; CUDA and the NPU described, as
``train --dry-run --device-kind`` does): set away from its default, it is either consumed -- it
changes what the run is computed from -- or refused by the recipe check (``--check``: exit 2, the
message naming the key). There is no third state: an option accepted and ignored costs a
cluster-day before anyone notices.

The walk enumerates the schema (:class:`areal_npu.recipe.RLConfig`), so a new key without an entry
in :data:`OBSERVED` fails here. Each entry names how its effect is seen, through the project's own
code on a small fixed input, compared with the defaults' (no engine started):

* ``engine`` -- the rollout engine's command line and environment on that platform;
* ``plan`` -- the placement plan of two 8-device nodes (processes, devices, env, transport);
* ``tiny`` -- the tiny model's checkpoint config and first weights;
* ``tasks`` -- the train and eval prompts; ``loss`` -- the PPO loss and stats of a fixed batch;
  ``advantages`` -- GRPO advantages of fixed rewards; ``optimizer`` -- AdamW's hyper-parameters
  and the learning rate over 60 steps; ``packing`` -- the micro-batch plan of fixed lengths;
* ``read:<module>`` -- keys whose effect is inside a training step, a warm start or the run loop
  (compute dtype, the MTP head, step counts, timeouts, retries): the module named reads the field
  (a static check, the weakest observation; none of these depends on the platform);
* ``refused`` -- refused by every platform (a refusal elsewhere counts too, naming the key or its
  section); ``platform`` -- ``device``, the walk's own parameter.

Keys read only in a context (speculation on, a schedule, a warm start) are changed in it
(:data:`WITH`). On the CPU every refusal is also run through ``areal-npu train --check`` (exit 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from areal_npu.config import ConfigError, validate_tree
from areal_npu.platform import described_device
from areal_npu.recipe import RLConfig, planning_only

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("cpu", "cuda", "npu")
MTP = ["rollout.spec.method=mtp", "rollout.spec.num_speculative_tokens=2"]
EAGLE3 = ["rollout.spec.method=eagle3", "rollout.spec.num_speculative_tokens=2"]
NGRAM = ["rollout.spec.method=ngram", "rollout.spec.num_speculative_tokens=2"]

# ---- observers: what the run computes from a validated config ----


def engine(cfg):
    return cfg.rollout.vllm_cli_args(port=8000), cfg.rollout.engine_env()


def plan(cfg):
    from areal_npu.placement import plan_recipe
    from areal_npu.placement.model import Cluster

    return json.dumps(plan_recipe(cfg, Cluster.uniform(cfg.device, 2, 8)).to_dict(), sort_keys=True)


def tiny(cfg):
    from areal_npu.model.tiny import build_tiny_model

    lm, _, _ = build_tiny_model(cfg.model.tiny)
    first = next(iter(lm.parameters()))
    return lm.config.to_json_string(), float(first.detach().double().sum())


def tasks(cfg):
    from areal_npu.agent.tasks import format_prompt, make_splits

    train, evals = make_splits(cfg.task)
    return [format_prompt(t) for t in train], [format_prompt(t) for t in evals]


def loss(cfg):
    from areal_npu.algo.ppo import decoupled_ppo_loss

    g = torch.Generator().manual_seed(0)
    n = 16
    logp = -2 + torch.randn(n, generator=g, dtype=torch.float64)
    value, stats = decoupled_ppo_loss(
        logp, torch.tensor([1.5, -1.5] * 8, dtype=torch.float64), torch.ones(n, dtype=torch.bool),
        logp_behave=logp + 0.8 * torch.randn(n, generator=g, dtype=torch.float64),
        logp_prox=logp - 1.5 * torch.randn(n, generator=g, dtype=torch.float64), config=cfg.ppo,
        cu_seqlens=torch.tensor([0, 5, 16]), logp_ref=logp + 0.3, entropy=torch.ones(n, dtype=torch.float64),
    )  # fmt: skip
    return float(value), {k: float(v) for k, v in stats.items()}


def advantages(cfg):
    from areal_npu.algo.advantages import grpo_advantages

    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.25] * 3)
    size = cfg.workflow.group_size if len(rewards) % cfg.workflow.group_size == 0 else 1
    return grpo_advantages(rewards, size, std_normalize=cfg.grpo.std_normalize)[0].tolist()


def optimizer(cfg):
    from areal_npu.train.optim import build_optimizer, lr_multiplier

    opt, _ = build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(1))]}], cfg.train.optim)
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return repr(hyper), [lr_multiplier(s, cfg.train.optim) for s in range(60)]


def packing(cfg):
    from areal_npu.data.packing import plan_micro_batches

    plans = []
    for lengths in ([5000, 3000, 2500, 2000, 1200, 700, 300, 64, 64, 5], [9000, 100]):
        try:
            plans.append(plan_micro_batches(lengths, cfg.train.packing))
        except ValueError as exc:  # a sequence over the cap with on_too_long=error
            plans.append(str(exc))
    return plans


OBSERVERS = {f.__name__: f for f in (engine, plan, tiny, tasks, loss, advantages, optimizer, packing)}

#: key -> how its effect is observed (module docstring); a ``read:`` entry names the reading module
OBSERVED: dict[str, str] = {
    "name": "read:areal_npu/run.py",  # the run directory (run_dir: runs/${name}) and the report's title
    "seed": "read:areal_npu/run.py",
    "run_dir": "read:areal_npu/run.py",
    "device": "platform",  # the parametrisation itself: test_the_platform_changes_the_engine
    **{f"model.tiny.{k}": "tiny" for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_attention_every", "mtp_num_hidden_layers",
        "max_position_embeddings", "seed", "layout", "linear_head_dim")},
    "model.path": "read:areal_npu/run.py",  # refused on the CPU: not a checkpoint; a plan accepts it
    **{f"task.{k}": "tasks" for k in ("n_train", "n_eval", "seed", "level", "n_examples", "n_tests", "families")},
    "task.kind": "refused", "task.dataset": "refused", "task.image_root": "refused", "task.snapshots": "refused",
    "warmstart.steps": "read:areal_npu/warmstart.py",
    **{f"warmstart.{k}": "read:areal_npu/warmstart.py" for k in ("batch_size", "lr", "log_every")},
    **{f"warmstart.{k}": "refused" for k in ("demo_turns", "demo_tasks")},  # repo tasks only
    "workflow.path": "read:areal_npu/agent/workflows.py",
    "workflow.group_size": "advantages",
    "workflow.max_new_tokens": "read:areal_npu/agent/workflows.py",
    "workflow.temperature": "refused", "workflow.top_p": "refused",
    "workflow.reward_workers": "read:areal_npu/agent/workflows.py",
    "workflow.grader_jail": "read:areal_npu/agent/workflows.py",
    **{f"workflow.{k}": "refused" for k in ("max_turns", "turn_discount", "zero_suspicious_reward")},
    **{f"workflow.shell.{k}": "refused" for k in (
        "max_tokens", "observation_chars", "observation_role", "system_prompt", "command_timeout_s",
        "episode_seconds", "repo_disk_mib", "env_workers", "harness", "harness_config", "tool_parser")},
    **{f"workflow.shell.env.{k}": "refused" for k in ("backend", "fallback", "warm", "allow_no_cgroup")},
    "rollout.model": "refused",
    "rollout.num_engines": "plan",
    "rollout.host": "engine",
    "rollout.base_port": "plan",
    "rollout.device": "refused",
    "rollout.dtype": "engine",
    "rollout.max_model_len": "engine",
    "rollout.seed": "engine",
    "rollout.enforce_eager": "engine",
    "rollout.enable_prefix_caching": "engine",
    "rollout.kv_cache_space_gib": "engine",
    "rollout.gpu_memory_utilization": "engine",
    "rollout.tensor_parallel_size": "engine",
    "rollout.top_k": "refused",
    "rollout.startup_timeout_s": "read:areal_npu/launch/engine_process.py",
    "rollout.request_timeout_s": "read:areal_npu/rollout/client.py",
    "rollout.max_retries": "read:areal_npu/rollout/client.py",
    "rollout.restart_on_failure": "read:areal_npu/rollout/client.py",
    "rollout.weight_transport": "plan",
    "rollout.weight_bucket_bytes": "read:areal_npu/rollout/client.py",
    "rollout.weight_sync_retries": "read:areal_npu/rollout/transports.py",
    "rollout.log_dir": "read:areal_npu/launch/engine_process.py",
    "rollout.extra_engine_args": "engine",
    **{f"rollout.spec.{k}": "engine" for k in (
        "method", "num_speculative_tokens", "draft_model", "draft_enforce_eager", "prompt_lookup_max",
        "prompt_lookup_min", "adaptive", "adapt")},
    "rollout.spec.off_keeps_drafter_kv": "read:areal_npu/rollout/server.py",
    "rollout.spec.mtp_draft_dir": "refused", "rollout.spec.sync_draft": "read:areal_npu/controller.py",
    "train.backend": "read:areal_npu/train/factory.py",
    "train.dp_size": "plan",
    "train.dtype": "read:areal_npu/train/fsdp2.py",
    "train.logprob_chunk_size": "read:areal_npu/train/fsdp2.py",
    "train.temperature": "refused",
    "train.gradient_checkpointing": "read:areal_npu/train/fsdp2.py",
    "train.ppo_minibatches": "read:areal_npu/run.py",
    "train.max_memory_fraction": "read:areal_npu/step_estimate.py",  # the dry run's memory budget
    **{f"train.optim.{k}": "optimizer" for k in (
        "lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "schedule", "total_steps", "min_lr_ratio")},
    "train.optim.grad_clip": "read:areal_npu/train/fsdp2.py",
    **{f"train.packing.{k}": "packing" for k in (
        "max_tokens_per_mb", "mode", "min_mbs", "mbs_divisor", "on_too_long", "tp_size", "cp_size",
        "cost_linear_coef")},
    **{f"train.megatron.{k}": "plan" for k in ("tp_size", "cp_size", "pp_size", "sequence_parallel")},
    **{f"ppo.{k}": "loss" for k in (
        "eps_clip_low", "eps_clip_high", "dual_clip", "decoupled", "behave_imp_weight_mode",
        "behave_imp_weight_cap", "behave_imp_weight_level", "loss_agg",
        )},
    "ppo.kl_coef": "refused", "ppo.kl_estimator": "refused", "ppo.on_nonfinite": "read:areal_npu/train/losses.py",
    **{f"mtp.{k}": "read:areal_npu/train/fsdp2.py" for k in ("enabled", "num_depths", "loss_scale", "init_new_head")},
    **{f"mtp.{k}": "read:areal_npu/model/mtp_params.py" for k in ("train", "mtp_only", "lr_scale")},
    **{f"mtp.{k}": "read:areal_npu/model/mtp_checkpoint.py" for k in ("num_layers", "init_std")},
    "eagle3.enabled": "read:areal_npu/run.py",  # builds, writes and trains the drafter the engines load
    **{f"eagle3.{k}": "read:areal_npu/model/eagle3.py" for k in ("aux_layers", "init_dir", "init_std")},
    **{f"eagle3.{k}": "read:areal_npu/train/fsdp2.py" for k in ("num_depths", "loss_scale", "lr_scale")},
    "grpo.std_normalize": "advantages",
    **{f"controller.{k}": "read:areal_npu/controller.py" for k in (
        "steps", "batch_groups", "max_staleness", "max_concurrent_groups", "checkpoint_every", "eval_every",
        "eval_size", "max_workflow_failures")},
}  # fmt: skip

#: the non-default value each key is set to (others: a bool flipped, a number changed)
VALUES: dict[str, str] = {
    "name": "other", "run_dir": "runs/elsewhere", "model.path": "/nonexistent/ckpt",
    "model.tiny.layout": "text", "model.tiny.num_hidden_layers": "8", "model.tiny.num_attention_heads": "8",
    "model.tiny.linear_head_dim": "64", "model.tiny.vocab_size": "384", "model.tiny.num_key_value_heads": "4",
    "task.level": "medium", "task.families": "[strlen]", "task.kind": "repo", "task.dataset": "tasks.jsonl",
    "task.image_root": "images", "task.snapshots": "snapshots", "warmstart.steps": "5", "warmstart.demo_tasks": "4",
    "workflow.path": "areal_npu.agent.workflows.MultiTurn", "workflow.grader_jail": "process",
    "workflow.temperature": "0.7", "workflow.top_p": "0.9",
    "workflow.shell.observation_role": "tool", "workflow.shell.system_prompt": "be brief",
    "workflow.shell.harness": "mini_swe", "workflow.shell.harness_config": "{step_limit: 3}",
    "workflow.shell.tool_parser": "hermes",
    "workflow.shell.env.backend": "bwrap", "workflow.shell.env.fallback": "process",
    "rollout.model": "/some/model", "rollout.host": "127.0.0.2",
    "rollout.base_port": "30000", "rollout.top_k": "20",
    "rollout.weight_transport": "gloo", "rollout.log_dir": "/tmp/engine-logs",
    "rollout.extra_engine_args": "{max_num_seqs: 8}", "rollout.weight_bucket_bytes": "536870912",
    "rollout.spec.method": "ngram", "rollout.spec.num_speculative_tokens": "3", "rollout.spec.draft_model": "/e",
    "rollout.spec.mtp_draft_dir": "/d", "rollout.spec.adapt": "{min_k: 1}",
    "train.backend": "megatron", "train.dtype": "bfloat16", "train.temperature": "0.7",
    "train.optim.schedule": "cosine", "train.optim.warmup_steps": "5", "train.packing.mode": "kk", "train.packing.on_too_long": "truncate",
    "train.packing.max_tokens_per_mb": "4096", "train.packing.min_mbs": "8", "train.packing.mbs_divisor": "4",
    "train.packing.cost_linear_coef": "0.0", "ppo.eps_clip_high": "0.28", "ppo.dual_clip": "3.0",
    "ppo.behave_imp_weight_mode": "clamp", "ppo.behave_imp_weight_cap": "3.0",
    "ppo.behave_imp_weight_level": "sequence", "ppo.loss_agg": "seq-mean", "ppo.kl_coef": "0.1",
    "ppo.kl_estimator": "k1", "ppo.on_nonfinite": "drop", "mtp.num_depths": "2", "mtp.num_layers": "2",
    "eagle3.aux_layers": "[0,1,2]", "eagle3.init_dir": "/nonexistent/drafter",
}  # fmt: skip
#: keys read only in a context (speculation on, a schedule...): the base their change is measured from
WITH: dict[str, list[str]] = {
    **{f"rollout.spec.{k}": MTP for k in ("num_speculative_tokens", "draft_enforce_eager", "adaptive",
                                          "sync_draft")},
    **{f"rollout.spec.{k}": [*MTP, "rollout.spec.adaptive=true"] for k in ("off_keeps_drafter_kv", "adapt")},
    **{f"rollout.spec.{k}": NGRAM for k in ("prompt_lookup_max", "prompt_lookup_min")},
    "eagle3.enabled": EAGLE3,
    **{f"eagle3.{k}": [*EAGLE3, "eagle3.enabled=true"] for k in (
        "aux_layers", "init_dir", "num_depths", "loss_scale", "lr_scale", "init_std")},
    "rollout.spec.draft_model": ["rollout.spec.method=draft_model", "rollout.spec.num_speculative_tokens=2",
                                 "rollout.spec.draft_model=/d"],
    "ppo.behave_imp_weight_cap": ["ppo.behave_imp_weight_mode=clamp", "ppo.behave_imp_weight_cap=2.0"],
    "ppo.behave_imp_weight_level": ["ppo.behave_imp_weight_mode=clamp", "ppo.behave_imp_weight_cap=2.0"],
    "train.optim.total_steps": ["train.optim.schedule=cosine", "train.optim.total_steps=50"],
    "train.optim.min_lr_ratio": ["train.optim.schedule=cosine", "train.optim.total_steps=50"],
    "train.packing.cost_linear_coef": ["train.packing.min_mbs=4"],
    # the warm start's schedule, read when there is one (a recipe may switch it off with steps=0)
    **{f"warmstart.{k}": ["warmstart.steps=5"] for k in ("batch_size", "lr", "log_every")},  # read when re-planning to a count
}  # fmt: skip
#: what a key's value needs beside it (set together with it, not in the base)
ALSO: dict[str, list[str]] = {
    "rollout.spec.method": ["rollout.spec.num_speculative_tokens=2"],
    "ppo.behave_imp_weight_mode": ["ppo.behave_imp_weight_cap=2.0"],
    "train.optim.schedule": ["train.optim.total_steps=50"],
}
#: a different value per platform (the default differs)
PER_PLATFORM = {
    "rollout.weight_transport": {"cpu": "gloo", "cuda": "rpc", "npu": "rpc"},
    "rollout.device": {"cpu": "npu", "cuda": "cpu", "npu": "cpu"},
    "rollout.dtype": {"cpu": "float32", "cuda": "bfloat16", "npu": "bfloat16"},
}


def leaves(node, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


SCHEMA = leaves(RLConfig())


def changed(key: str, platform: str = "cpu") -> str:
    if key in PER_PLATFORM:
        return PER_PLATFORM[key][platform]
    if key in VALUES:
        return VALUES[key]
    default = SCHEMA[key]
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        return str(default + 1 if default > 0 else 1)
    if isinstance(default, float):
        return str(default / 2 if default > 0 else 0.5)
    raise AssertionError(f"{key}: give a non-default value in VALUES (default {default!r})")


def resolve(platform: str, overrides: list[str]) -> RLConfig:
    """What ``train --check`` validates (:func:`validate_tree`, the checks ``load_config`` runs after
    OmegaConf's typing, which costs 0.1 s a load), on ``cuda`` / ``npu`` for a described machine."""
    cfg = RLConfig()
    for item in [f"device={platform}", *overrides]:
        key, _, text = item.partition("=")
        *parents, leaf = key.split(".")
        node = functools.reduce(getattr, parents, cfg)
        assert leaf in {f.name for f in dataclasses.fields(node)}, key
        value = yaml.safe_load(text)
        if isinstance(getattr(node, leaf), float) and isinstance(value, (int, str)):
            value = float(value)  # YAML 1.1 reads 5e-06 as a string; the schema types it float
        setattr(node, leaf, value)
    with contextlib.ExitStack() as scope:
        if platform != "cpu":
            scope.enter_context(described_device(platform))
            scope.enter_context(planning_only())
        validate_tree(cfg)
    return cfg


#: observers whose result depends on the platform (the others are computed once for all three)
PLATFORM_OBSERVERS = ("engine", "plan")


def observed(platform: str, how: str, overrides: tuple[str, ...]):
    return _observed(platform if how in PLATFORM_OBSERVERS else "cpu", how, overrides)


@functools.cache
def _observed(platform: str, how: str, overrides: tuple[str, ...]):
    return OBSERVERS[how](resolve(platform, list(overrides)))


def test_every_key_has_an_entry_and_every_entry_a_key():
    assert sorted(set(SCHEMA) - set(OBSERVED)) == [], "new keys: say how each is observed in OBSERVED"
    assert sorted(set(OBSERVED) - set(SCHEMA)) == [], "keys that are no longer in the schema"


def refusal_names(exc: ConfigError, key: str) -> bool:
    """The refusal names ``key``, or the section it is in (``workflow.shell: is not read by ...``)."""
    return exc.key == key or key.startswith(exc.key + ".") or key in str(exc)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_key_is_consumed_or_refused(platform, tmp_path):
    ignored, wrong, refused = [], [], []
    for key in SCHEMA:
        how = OBSERVED.get(key)
        if how is None:
            wrong.append(f"{key}: no entry in OBSERVED")
            continue
        if how == "platform":
            continue
        base = WITH.get(key, [])
        overrides = [*base, *ALSO.get(key, []), f"{key}={changed(key, platform)}"]
        try:
            resolve(platform, overrides)
        except ConfigError as exc:
            if not refusal_names(exc, key):
                wrong.append(f"{key}: refused without naming it ({exc})")
            refused.append(overrides)
            continue
        if how == "refused":
            wrong.append(f"{key}: accepted, but OBSERVED says it is refused")
        elif how.startswith("read:"):
            module, leaf = how.removeprefix("read:"), key.rsplit(".", 1)[-1]
            if f".{leaf}" not in (ROOT / module).read_text():
                wrong.append(f"{key}: {module} does not read .{leaf}")
        elif observed(platform, how, tuple(overrides)) == observed(platform, how, tuple(base)):
            ignored.append(f"{key}={changed(key, platform)} (observed by {how})")
    assert not ignored, f"accepted and ignored on {platform}: {ignored}"
    assert not wrong, wrong
    if platform == "cpu":  # the command itself: exit 2 and one line (a plan for cuda / npu is --dry-run's)
        from areal_npu import cli

        recipe = tmp_path / "recipe.yaml"
        recipe.write_text("device: cpu\n")
        for overrides in refused:  # (not capsys: a logger first used here would keep its closed stream)
            with contextlib.redirect_stderr(io.StringIO()) as stderr:
                assert cli.main(["train", str(recipe), "--check", *overrides]) == 2, overrides
            err = stderr.getvalue().strip().splitlines()
            assert len(err) == 1 and err[0].startswith("config error: "), (overrides, err)


def test_the_platform_changes_the_engine():
    """``device`` is the parametrisation of the walk: each platform starts its engines differently."""
    seen = {platform: observed(platform, "engine", ()) for platform in PLATFORMS}
    assert len({json.dumps(v, sort_keys=True) for v in seen.values()}) == len(PLATFORMS), seen
