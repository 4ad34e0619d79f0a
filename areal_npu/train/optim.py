"""Optimizer and learning-rate schedule of the train engines."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear (decay after warmup to min_lr_ratio)
    total_steps: int = 0  # needed by cosine / linear
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def validate(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"schedule must be constant, cosine or linear, got {self.schedule!r}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"total_steps must exceed warmup_steps for schedule {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("min_lr_ratio must be in [0, 1]")
        if self.grad_clip < 0:
            raise ValueError("grad_clip must be >= 0 (0 disables clipping)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("beta1 must be in [0, 1) (and beta2)")


def lr_multiplier(step: int, cfg: OptimConfig) -> float:
    """lr(step) / lr: linear warmup over ``warmup_steps``, then constant, cosine or linear decay
    to ``min_lr_ratio`` at ``total_steps``. ``step`` counts optimizer steps already taken."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_optimizer(param_groups: list[dict], cfg: OptimConfig):
    """AdamW over ``param_groups`` (each may carry its own ``lr``) and its LambdaLR schedule."""
    cfg.validate()
    optimizer = torch.optim.AdamW(
        param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    return optimizer, scheduler
