"""``areal-npu train RECIPE``: set up a run directory, warm-start, launch the engines, run the loop.

Run directory: ``config.yaml`` (resolved), ``metrics.jsonl``, ``tb/``, ``base_model/`` (the tiny
model when no checkpoint is given), ``warmstart/`` (the SFT-warm-started policy + MTP head the
engines start from), ``checkpoints/step_N`` (atomic; ``--resume`` continues after the latest),
``engines/`` (engine logs). Child processes are stopped on every exit path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from pathlib import Path

import torch

from areal_npu import names
from areal_npu.config import ConfigError, to_yaml
from areal_npu.recipe import RLConfig


async def _run_loop(
    cfg: RLConfig, engine, tokenizer, tasks, eval_tasks, run_dir, logger, start_step, engines, rollout_cfg
):
    from areal_npu.agent.workflows import load_workflow
    from areal_npu.controller import RLController
    from areal_npu.rollout.client import RolloutClient
    from areal_npu.rollout.transports import make_weight_sync
    from areal_npu.train.losses import PPOLoss

    controller_ref: dict = {}

    async def on_restart(i: int) -> None:
        # A restarted engine serves the checkpoint it was started from: bring it to the current weights.
        controller = controller_ref.get("c")
        if controller is not None and controller.last_named is not None:
            await controller.weight_sync.resync(
                i, controller.last_named, controller.version, sync_draft=controller.sync_draft
            )

    client = RolloutClient.from_config(rollout_cfg, engines, on_restart=on_restart)
    try:
        # the transport rollout.weight_transport resolves to (one node: the trainer at 127.0.0.1)
        weight_sync = make_weight_sync(rollout_cfg, client)
        controller = RLController(
            cfg.controller, engine, tokenizer, client, tasks, run_dir, logger,
            spec=cfg.rollout.spec, grpo=cfg.grpo, loss=PPOLoss(cfg.ppo), seed=cfg.seed,
            weight_bucket_bytes=cfg.rollout.weight_bucket_bytes, start_step=start_step, eval_tasks=eval_tasks,
            weight_sync=weight_sync,
        )  # fmt: skip
        controller_ref["c"] = controller
        if start_step > 0:
            await controller.push_weights()  # engines restarted from the checkpoint: tag their version
        return await controller.run(load_workflow(cfg.workflow, tokenizer))
    finally:
        await client.aclose()


def _warn(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[yellow]warning:[/] {escape(message)}")


def run_rl(cfg: RLConfig, resume: bool = False) -> dict:
    """The whole job; returns a summary (start/end reward, steps, seconds)."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from areal_npu.agent.tasks import make_splits
    from areal_npu.metrics import StatsLogger
    from areal_npu.model.tiny import save_tiny_model
    from areal_npu.rollout.launcher import launch_engines
    from areal_npu.train.checkpoint import checkpoint_to_resume
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.factory import build_engine, check_world_size
    from areal_npu.train.warmstart import warm_start

    console = Console()
    start_time = time.time()
    run_dir = Path(cfg.run_dir)
    check_world_size(cfg.train, int(os.environ.get("WORLD_SIZE", 1)))  # the layout fits the trainer processes
    # verified before any work starts: a damaged checkpoint falls back or stops here (exit 2)
    checkpoint = checkpoint_to_resume(run_dir / "checkpoints", warn=_warn) if resume else None
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            "run_dir", f"{run_dir} already holds a run: pass --resume, or choose another name/run_dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    init_distributed()
    train_tasks, eval_tasks = make_splits(cfg.task)

    if checkpoint is not None:
        policy_dir = checkpoint
    else:
        base = (
            Path(cfg.model.path)
            if cfg.model.path
            else save_tiny_model(run_dir / "base_model", cfg.model.tiny)
        )
        policy_dir = base
        if cfg.warmstart.steps:
            policy_dir = warm_start(
                base, train_tasks, run_dir / "warmstart", console,
                cfg=cfg.warmstart, train=cfg.train, mtp=cfg.mtp, seed=cfg.seed, workflow=cfg.workflow,
            )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    engine = build_engine(cfg.train, policy_dir, cfg.mtp, tokenizer.pad_token_id)
    start_step = 0
    logger = StatsLogger(run_dir, cfg.controller.steps)
    if checkpoint is not None:
        extra = engine.load_checkpoint(checkpoint)
        start_step = int(extra["step"]) + 1
        logger.truncate_after(int(extra["step"]))
        console.print(f"resumed from {checkpoint} at step {start_step} (weight version {engine.version})")

    rollout_cfg = dataclasses.replace(cfg.rollout, model=str(policy_dir), log_dir=str(run_dir / "engines"))
    with console.status(f"starting {rollout_cfg.num_engines} vLLM engine(s) on {policy_dir.name}"):
        engines = launch_engines(rollout_cfg)
    try:
        history = asyncio.run(
            _run_loop(
                cfg, engine, tokenizer, train_tasks, eval_tasks, run_dir, logger, start_step, engines, rollout_cfg
            )
        )
    finally:
        for e in engines:
            e.stop()
        logger.close()
    rewards = [h[names.REWARD_MEAN] for h in history]
    return {
        "steps": len(history),
        "start_step": start_step,
        "seconds": time.time() - start_time,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
    }
