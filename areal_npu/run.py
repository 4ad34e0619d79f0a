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
        if controller is not None:
            await controller.resync_engine(i)

    client = RolloutClient.from_config(rollout_cfg, engines, on_restart=on_restart)
    try:
        # the transport rollout.weight_transport resolves to (one node: the trainer at 127.0.0.1)
        weight_sync = make_weight_sync(rollout_cfg, client)
        controller = RLController(
            cfg.controller, engine, tokenizer, client, tasks, run_dir, logger,
            spec=cfg.rollout.spec, grpo=cfg.grpo, loss=PPOLoss(cfg.ppo), seed=cfg.seed,
            start_step=start_step, eval_tasks=eval_tasks,
            weight_sync=weight_sync,
        )  # fmt: skip
        controller_ref["c"] = controller
        if start_step > 0:
            await controller.push_weights()  # engines restarted from the checkpoint: tag their version
        workflow = load_workflow(cfg.workflow, tokenizer)
        try:
            return await controller.run(workflow)
        finally:
            if hasattr(workflow, "aclose"):  # what it started (the shell agent's warm pool and gateway)
                await workflow.aclose()
            elif hasattr(workflow, "close"):
                workflow.close()
    finally:
        await client.aclose()


def _warn(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[yellow]warning:[/] {escape(message)}")


def _base_policy(cfg: RLConfig, run_dir: Path, train_tasks, console, rank: int) -> Path:
    """The checkpoint the engines start from: ``model.path`` or the tiny model (written by rank 0),
    warm-started when ``warmstart.steps`` asks. The warm start runs SPMD on every rank: each takes
    the same batches, and the engines' global normalisation makes that the 1-rank update; rank 0
    writes the result, which every rank reads after the barrier."""
    import torch.distributed as dist

    from areal_npu.model.tiny import save_tiny_model
    from areal_npu.warmstart import warm_start

    base = Path(cfg.model.path) if cfg.model.path else run_dir / "base_model"
    if not cfg.model.path and rank == 0:
        save_tiny_model(base, cfg.model.tiny)
    dist.barrier()
    if not cfg.warmstart.steps:
        return base
    if cfg.warmstart.demo_tasks:  # demonstrations on embedded repo tasks, whatever the run trains on
        from areal_npu.agent.repo_tasks import make_repo_tasks

        train_tasks = make_repo_tasks(cfg.warmstart.demo_tasks, cfg.seed, cfg.task.families)
    out = warm_start(
        base, train_tasks, run_dir / "warmstart", console,
        cfg=cfg.warmstart, train=cfg.train, mtp=cfg.mtp, seed=cfg.seed, workflow=cfg.workflow,
    )  # fmt: skip
    dist.barrier()
    return out


def _trainer(cfg: RLConfig, policy_dir: Path, checkpoint: Path | None, pad_token_id: int):
    """``(train engine, the checkpoint's extra state or None)``: built on ``policy_dir``, resumed
    from ``checkpoint`` when given. With ``eagle3.enabled`` the engine trains a drafter (the initial
    one: ``eagle3.init_dir``'s or a new one), and the drafter the engines start from
    (``rollout.spec.draft_model``, recipe.py derives the path) is written from the engine *after*
    the resume: a resumed run's engines start from the trained drafter the checkpoint holds, not
    from a fresh one. Collective (every rank builds, loads and gathers the drafter); rank 0 writes the drafter."""
    from areal_npu.train.factory import build_engine

    drafter = None
    if cfg.eagle3.enabled:
        from areal_npu.model.eagle3 import initial_drafter

        drafter = initial_drafter(policy_dir, cfg.eagle3, cfg.seed)
    engine = build_engine(cfg.train, policy_dir, cfg.mtp, pad_token_id, drafter, cfg.eagle3)
    extra = engine.load_checkpoint(checkpoint) if checkpoint is not None else None
    if cfg.eagle3.enabled:  # in the policy's dtype: vLLM loads a drafter in the target model's dtype
        from transformers import AutoConfig

        from areal_npu.model.layout import declared_dtype
        from areal_npu.train.fsdp2_checkpoint import write_eagle3_drafter

        dtype = declared_dtype(AutoConfig.from_pretrained(policy_dir))
        write_eagle3_drafter(engine, cfg.rollout.spec.draft_model, dtype)
    return engine, extra


def run_rl(cfg: RLConfig, resume: bool = False) -> dict:
    """The whole job; returns a summary (start/end reward, steps, seconds).

    Under torchrun (``WORLD_SIZE`` > 1) every trainer rank calls it: rank 0 starts the engines and
    runs the controller, the other ranks follow it (:mod:`areal_npu.train.ranks`) and return
    ``{"rank": r, "stopped_by": <rank 0's error or None>}``. On the CPU each rank first binds
    itself to the cores the placement plan gives it."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from areal_npu.agent.tasks import make_splits
    from areal_npu.launch.engines import launch_engines
    from areal_npu.metrics import StatsLogger
    from areal_npu.rollout.dense_mtp import serve_with_split_drafter
    from areal_npu.train import ranks
    from areal_npu.train.checkpoint import checkpoint_to_resume
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.factory import check_world_size

    start_time = time.time()
    run_dir = Path(cfg.run_dir)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    check_world_size(cfg.train, world)  # the layout fits the trainer processes
    console = Console(quiet=rank != 0)
    machine_cores = os.sched_getaffinity(0)  # before this rank narrows it: the engines split these
    if world > 1:
        ranks.pin_trainer_cores(ranks.trainer_cores(cfg, rank))
    # verified before any work starts: a damaged checkpoint falls back or stops here (exit 2)
    warn = _warn if rank == 0 else (lambda _message: None)
    checkpoint = checkpoint_to_resume(run_dir / "checkpoints", warn=warn) if resume else None
    if not resume and (run_dir / "metrics.jsonl").exists():  # every rank: metrics.jsonl comes after init
        raise ConfigError(
            "run_dir", f"{run_dir} already holds a run: pass --resume, or choose another name/run_dir"
        )
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    init_distributed()
    train_tasks, eval_tasks = make_splits(cfg.task)

    policy_dir = (
        checkpoint if checkpoint is not None else _base_policy(cfg, run_dir, train_tasks, console, rank)
    )
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    engine, extra = _trainer(cfg, policy_dir, checkpoint, tokenizer.pad_token_id)
    start_step = 0
    leader = None
    if world > 1:
        channel = ranks.RankChannel(data=ranks.data_rank(engine))  # Megatron: TP/CP peers share samples
        if rank != 0:
            return {"rank": rank, "stopped_by": ranks.follow(engine, channel)}
        engine = leader = ranks.LeaderEngine(engine, channel, cfg.train.ppo_minibatches)
    logger = StatsLogger(run_dir, cfg.controller.steps)
    if extra is not None:
        start_step = int(extra["step"]) + 1
        logger.truncate_after(int(extra["step"]))
        console.print(f"resumed from {checkpoint} at step {start_step} (weight version {engine.version})")

    rollout_cfg = dataclasses.replace(cfg.rollout, model=str(policy_dir), log_dir=str(run_dir / "engines"))
    # a dense (Qwen3) policy drafting with its MTP head: served from two directories (why: the module)
    rollout_cfg = serve_with_split_drafter(rollout_cfg, policy_dir, run_dir / "served")
    engines = []
    error = None
    try:
        with console.status(f"starting {rollout_cfg.num_engines} vLLM engine(s) on {policy_dir.name}"):
            with ranks.cpu_affinity(machine_cores if world > 1 else None):
                engines = launch_engines(rollout_cfg)
        history = asyncio.run(
            _run_loop(
                cfg,
                engine,
                tokenizer,
                train_tasks,
                eval_tasks,
                run_dir,
                logger,
                start_step,
                engines,
                rollout_cfg,
            )
        )
    except BaseException as exc:
        error = exc
        raise
    finally:
        if leader is not None:
            leader.stop(error)  # the followers return (with the error) instead of waiting
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
