"""Supervised warm start before RL: policy and MTP head trained on the task's reference answers.

``areal-npu train`` runs it when ``warmstart.steps > 0`` (:func:`areal_npu.run.run_rl`): the base
checkpoint is loaded into the run's train engine, trained with ``SFTLoss`` (next-token loss of the
policy plus the MTP loss), and written back as a Hugging Face checkpoint with ``mtp.*`` in the base
checkpoint's layout (text or published), which the engines then start from.

A package-level module, not under ``train/``: it joins a train engine with the agent's tasks and
demonstrations, and ``train`` and ``agent`` are siblings that never import each other.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

from areal_npu import names
from areal_npu.data.sample import TrainSample
from areal_npu.data.trajectory import sft_sample


@dataclass
class WarmStartConfig:
    """Supervised warm start of policy and MTP head on the task's reference answers."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 2e-3
    log_every: int = 25
    # turns of each shell-agent demonstration (repo tasks): 4 look, fix, test, submit; fewer drop the
    # test run, then the look; 0: workflow.max_turns. Two turns (fix, submit) keep the samples short
    demo_turns: int = 0
    # repo tasks: 0 records the demonstrations on the run's training tasks; N on N embedded repo tasks
    # (the only ones with reference fixes): how a task.dataset run learns the harness's action format
    demo_tasks: int = 0

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not self.lr > 0:
            raise ValueError("lr must be > 0")
        if self.demo_turns < 0:
            raise ValueError("demo_turns must be >= 0 (0: workflow.max_turns)")
        if self.demo_tasks < 0:
            raise ValueError("demo_tasks must be >= 0 (0: the run's training tasks)")


def warm_start_samples(tokenizer, pairs: list[tuple[str, str]]) -> list[TrainSample]:
    return [
        sft_sample(
            tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(a, add_special_tokens=False)
        )
        for p, a in pairs
    ]


def warm_start(
    base_dir: Path, tasks, out_dir: Path, console, *, cfg: WarmStartConfig, train, mtp, seed: int,
    workflow=None,
) -> Path:
    """SFT of policy and MTP head on the reference answers of ``tasks``; writes an HF checkpoint
    with ``mtp.*`` in the base checkpoint's layout. ``train``, ``mtp``: the run's train engine and
    MTP configs: the engine is the run's own (:func:`areal_npu.train.factory.build_engine`, the
    ``SFTLoss``), with the warm start's optimizer. Repo tasks train on
    recorded shell-agent demonstrations (:mod:`areal_npu.agent.demos`) under ``workflow``, the run's
    workflow config."""
    from rich.progress import Progress
    from transformers import AutoTokenizer

    from areal_npu.agent.demos import demo_samples
    from areal_npu.agent.repo_task import RepoTask
    from areal_npu.agent.tasks import sft_pairs
    from areal_npu.train.factory import build_engine
    from areal_npu.train.losses import SFTLoss
    from areal_npu.train.optim import OptimConfig

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    optim = OptimConfig(
        lr=cfg.lr,
        warmup_steps=min(20, cfg.steps // 10),
        schedule="cosine",
        total_steps=cfg.steps + 1,
        min_lr_ratio=0.1,
    )
    train_cfg = dataclasses.replace(train, optim=optim, ppo_minibatches=1)
    engine = build_engine(train_cfg, base_dir, mtp, tokenizer.pad_token_id)
    if tasks and isinstance(tasks[0], RepoTask):
        if workflow is None:
            raise ValueError("repo tasks warm-start on shell-agent demonstrations: pass the run's workflow config")
        demo_workflow = dataclasses.replace(workflow, max_turns=cfg.demo_turns or workflow.max_turns)
        with console.status(f"recording {len(tasks)} demonstration episodes"):
            samples = demo_samples(tokenizer, tasks, demo_workflow)
    else:
        samples = warm_start_samples(tokenizer, sft_pairs(tasks))
    rng = random.Random(seed)
    loss = SFTLoss()
    with Progress(console=console, transient=False) as progress:
        bar = progress.add_task("warm start (SFT policy + MTP)", total=cfg.steps)
        for step in range(cfg.steps):
            stats = engine.train_step(rng.sample(samples, min(cfg.batch_size, len(samples))), loss)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                keys = (names.SFT_NLL, names.mtp_loss_key(1), names.mtp_acc_key(1))
                progress.console.print(
                    f"warm start {step + 1}/{cfg.steps}: "
                    + "  ".join(f"{k} {stats[k]:.3f}" for k in keys if k in stats)
                )
            progress.advance(bar)
    # in the base checkpoint's layout: a published one stays loadable by vLLM's VL class
    engine.save_hf_checkpoint(out_dir, tokenizer)
    del engine
    return out_dir
