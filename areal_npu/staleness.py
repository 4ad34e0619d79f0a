"""Staleness control for asynchronous RL (pure bookkeeping, no I/O).

Step s trains policy version s on ``B`` groups. A group admitted while the rollout engines serve
version v and consumed at step s is ``s - v`` versions stale. Groups are admitted in the order they
will be consumed, so the next group's consumption step is ``(consumed + pending) // B``, and

    admit  iff  (consumed + pending) // B - version <= max_staleness.

``max_staleness = 0`` is synchronous RL: the groups of step s start only once version s is served.
Groups can finish out of order, so consumption re-checks every trajectory against the bound and
drops (and counts) the rare late one; the bound therefore holds for every consumed trajectory,
also after a resume, where the gate restarts from the checkpoint's step and version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessGate:
    batch_groups: int
    max_staleness: int
    consumed: int = 0  # groups consumed by training so far
    pending: int = 0  # groups admitted and not yet consumed (in flight or buffered)
    dropped: int = 0  # groups dropped at consumption for exceeding the bound

    def __post_init__(self):
        if self.batch_groups < 1:
            raise ValueError("batch_groups must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")

    @classmethod
    def resumed(cls, batch_groups: int, max_staleness: int, next_step: int) -> StalenessGate:
        """The gate of a run resumed at ``next_step``: everything before it consumed, nothing pending."""
        return cls(batch_groups, max_staleness, consumed=next_step * batch_groups)

    def can_admit(self, version: int) -> bool:
        return (self.consumed + self.pending) // self.batch_groups - version <= self.max_staleness

    def admit(self) -> None:
        self.pending += 1

    def consume(self, n: int = 1) -> None:
        self.pending -= n
        self.consumed += n

    def drop(self, n: int = 1) -> None:
        """A finished group that will not be trained on (too stale, or its generation failed)."""
        self.pending -= n
        self.dropped += n

    def fresh_enough(self, step: int, oldest_version: int) -> bool:
        return oldest_version < 0 or step - oldest_version <= self.max_staleness
