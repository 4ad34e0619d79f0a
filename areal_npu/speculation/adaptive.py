"""Adaptive speculation at run time: one step's rollout metrics in, the engines' draft length out.

Glue between the pure policy (:class:`areal_npu.speculation.policy.AdaptiveSpec`) and the engines
(``RolloutClient.set_spec_k``; engines started with ``spec.adaptive``, see
:mod:`areal_npu.speculation.k_driver`). Per step it reads what the engines measured since the previous
step -- per-position acceptance ``rollout/spec_accept_rate_pos{i}`` and
``rollout/tokens_per_busy_s`` (generated tokens per second an engine had work, so idle time waiting
for the trainer does not count) -- asks the policy, applies a changed draft length to every engine,
and records the change with its reason. With ``adapt.by_context`` the k is one per context bucket
(:class:`areal_npu.speculation.context_k.ContextAwareK`, from ``rollout/spec_ctx_*``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from areal_npu import names
from areal_npu.speculation.context_k import ContextAwareK
from areal_npu.speculation.policy import AdaptiveSpec, SpecAdaptConfig, SpecDecision


def accept_per_pos(stats: dict[str, float], k: int) -> list[float]:
    """``u_0 .. u_{k-1}`` from one step's stats (0 where absent)."""
    return [float(stats.get(names.spec_accept_rate_pos_key(i), 0.0)) for i in range(k)]


class AdaptiveSpecDriver:
    def __init__(
        self,
        client,
        config: SpecAdaptConfig,
        log: Callable[[str], None] = print,
        decisions_path: Path | None = None,
    ):
        self.client = client
        self.policy = AdaptiveSpec(config)
        self.by_context = ContextAwareK(config) if config.by_context else None
        self.log = log
        self.decisions_path = decisions_path

    @property
    def k(self) -> int:
        return self.policy.k

    async def start(self) -> None:
        """Put every engine on the policy's first draft length (per context bucket with ``by_context``)."""
        if self.by_context is not None:
            await self.client.set_spec_k(self.by_context.k[0], list(self.by_context.k))
        else:
            await self.client.set_spec_k(self.policy.k)

    async def step(self, step: int, stats: dict[str, float]) -> dict[str, float]:
        """Feed one step's measurements; returns ``rollout/spec_k`` (the k this step ran with) and
        ``rollout/spec_k_next`` (with ``by_context``: the mean k drafted per verify step, and
        ``rollout/spec_ctx_<bucket>_k`` for the next step). Call after ``client.step_metrics()``."""
        if self.by_context is not None:
            return await self._step_by_context(step, stats)
        k_ran = self.policy.k
        throughput = stats.get(names.TOKENS_PER_BUSY_S, 0.0)
        decision = self.policy.observe(k_ran, accept_per_pos(stats, k_ran), throughput)
        if decision is not None:
            await self.client.set_spec_k(decision.k_to)
            self._record(step, decision)
        return {names.SPEC_K: float(k_ran), names.SPEC_K_NEXT: float(self.policy.k)}

    async def _step_by_context(self, step: int, stats: dict[str, float]) -> dict[str, float]:
        before = list(self.by_context.k)
        table = self.by_context.observe(stats)
        if table != before:
            await self.client.set_spec_k(table[0], table)
            self._record(
                step, SpecDecision(step, max(before), max(table), f"k per context bucket {before} -> {table}")
            )
        drafts = stats.get(names.SPEC_DRAFTS, 0.0)
        k_ran = stats.get(names.SPEC_DRAFT_TOKENS, 0.0) / drafts if drafts else 0.0
        return {
            names.SPEC_K: float(round(k_ran)),
            names.SPEC_K_NEXT: float(max(table)),
        } | self.by_context.table_stats()

    def _record(self, step: int, decision: SpecDecision) -> None:
        self.log(f"[spec] step {step}: k {decision.k_from} -> {decision.k_to}: {decision.reason}")
        if self.decisions_path is not None:
            row = {"step": step, "k_from": decision.k_from, "k_to": decision.k_to, "reason": decision.reason}
            with open(self.decisions_path, "a") as f:
                f.write(json.dumps(row) + "\n")
