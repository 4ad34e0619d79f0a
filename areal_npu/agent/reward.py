"""Reward for the program-synthesis task: the fraction of hidden tests the answer passes in the sandbox.

Every reward comes with one reason from :data:`areal_npu.agent.sandbox.REASONS` ("ok",
"wrong_answer", "timeout", ...); :func:`reward_stats` turns a batch of them into logging counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from areal_npu import names
from areal_npu.agent.sandbox import REASONS, SandboxLimits, SandboxResult, grade_many
from areal_npu.agent.tasks import Task, extract_program, to_program


def _items(tasks: Sequence[Task], completions: Sequence[str]) -> list[tuple[str, list]]:
    if len(tasks) != len(completions):
        raise ValueError(f"completions: got {len(completions)} for {len(tasks)} tasks")
    return [(to_program(extract_program(c)), list(t.tests)) for t, c in zip(tasks, completions)]


def grade_completions(
    tasks: Sequence[Task],
    completions: Sequence[str],
    max_workers: int = 4,
    limits: SandboxLimits | None = None,
) -> list[SandboxResult]:
    """Full sandbox results for ``completions[i]`` answering ``tasks[i]``, graded concurrently."""
    return grade_many(_items(tasks, completions), max_workers=max_workers, limits=limits)


def reward_many(
    tasks: Sequence[Task],
    completions: Sequence[str],
    max_workers: int = 4,
    limits: SandboxLimits | None = None,
) -> list[tuple[float, str]]:
    """``(reward, reason)`` per completion; reward = passed / total hidden tests, 0 on any failure."""
    return [(r.fraction, r.reason) for r in grade_completions(tasks, completions, max_workers, limits)]


def reward(task: Task, completion_text: str, limits: SandboxLimits | None = None) -> tuple[float, str]:
    """``(fraction of task.tests passed, reason)`` for one completion."""
    return reward_many([task], [completion_text], max_workers=1, limits=limits)[0]


def reward_stats(reasons: Iterable[str]) -> dict[str, int]:
    """Counts per reason for logging, every known reason present (zeros included) so curves line up:
    ``{"reward/reason_ok": 3, "reward/reason_timeout": 1, ...}``. Unknown reasons are counted too."""
    counts = Counter(reasons)
    stats = {names.reward_reason_key(name): counts.pop(name, 0) for name in REASONS}
    stats.update({names.reward_reason_key(name): n for name, n in sorted(counts.items())})
    return stats
