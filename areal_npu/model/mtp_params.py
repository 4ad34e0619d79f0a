"""Which parameters train, and which are exported to the rollout engines, in each MTP mode.

| mode       | policy params            | mtp.* params              | weight sync          |
|------------|--------------------------|---------------------------|----------------------|
| `off`      | trainable                | (no head)                 | policy               |
| `joint`    | trainable                | trainable (lr x lr_scale) | policy + mtp.*       |
| `frozen`   | trainable                | frozen, loaded once       | policy               |
| `mtp_only` | frozen                   | trainable                 | mtp.*                |

The embedding and output head are policy parameters in every mode: the MTP path uses them detached.
"mtp.* params" are the ones vLLM drafts with (:meth:`Qwen35MTP.named_drafting_parameters`): extra
layers of a multi-layer checkpoint head are never used by vLLM, so they neither train nor sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal_npu.model.mtp import MTPConfig, Qwen35MTP
from areal_npu.names import MTP_PREFIX

__all__ = ["MTPParamGroups", "apply_mtp_mode", "mtp_mode", "mtp_param_groups", "weight_sync_names"]


def mtp_mode(cfg: MTPConfig) -> str:
    """``"off"``, ``"joint"``, ``"frozen"`` or ``"mtp_only"`` of a validated ``cfg``."""
    if not cfg.enabled:
        return "off"
    if not cfg.train:
        return "frozen"
    return "mtp_only" if cfg.mtp_only else "joint"


@dataclass
class MTPParamGroups:
    """Trainable ``(name, param)`` per group; MTP names carry the ``mtp.`` checkpoint prefix."""

    policy: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    mtp: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    mtp_lr_scale: float = 1.0

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.policy] + [n for n, _ in self.mtp]

    def optimizer_groups(self, lr: float, **extra) -> list[dict]:
        """Param groups for a torch optimizer (empty groups left out)."""
        groups = []
        if self.policy:
            groups.append({"params": [p for _, p in self.policy], "lr": lr, "name": "policy", **extra})
        if self.mtp:
            groups.append(
                {"params": [p for _, p in self.mtp], "lr": lr * self.mtp_lr_scale, "name": "mtp", **extra}
            )
        return groups


def _unique_named(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Parameter]]:
    return [(prefix + n, p) for n, p in module.named_parameters()]  # named_parameters dedups tied weights


def mtp_param_groups(model: torch.nn.Module, mtp: Qwen35MTP | None, cfg: MTPConfig) -> MTPParamGroups:
    """The trainable parameters of ``cfg``'s mode (see the module table)."""
    mode = mtp_mode(cfg)
    if mode in ("joint", "mtp_only", "frozen") and mtp is None:
        raise ValueError(f"MTP mode {mode!r} needs an MTP head, got None")
    groups = MTPParamGroups(mtp_lr_scale=cfg.lr_scale if mode == "joint" else 1.0)
    if mode != "mtp_only":
        groups.policy = _unique_named(model)
    if mode in ("joint", "mtp_only"):
        groups.mtp = [(MTP_PREFIX + n, p) for n, p in mtp.named_drafting_parameters()]
    return groups


def apply_mtp_mode(model: torch.nn.Module, mtp: Qwen35MTP | None, cfg: MTPConfig) -> MTPParamGroups:
    """Set ``requires_grad`` to match the mode and return its groups."""
    groups = mtp_param_groups(model, mtp, cfg)
    trainable = {id(p) for _, p in groups.policy + groups.mtp}
    for module in (model, mtp):
        if module is not None:
            for p in module.parameters():
                p.requires_grad_(id(p) in trainable)
    return groups


def weight_sync_names(model: torch.nn.Module, mtp: Qwen35MTP | None, cfg: MTPConfig) -> dict[str, list[str]]:
    """Checkpoint-format names to push to the rollout engines after a step: ``{"policy": [...],
    "mtp": [...]}``. vLLM loads the two separately (the drafter is its own module), so they are
    kept apart. Frozen parts are not exported: they were loaded with the checkpoint."""
    mode = mtp_mode(cfg)
    policy = [] if mode == "mtp_only" else list(model.state_dict().keys())
    head = (
        [MTP_PREFIX + n for n, _ in mtp.named_drafting_parameters()]
        if mode in ("joint", "mtp_only") and mtp
        else []
    )
    return {"policy": policy, "mtp": head}
