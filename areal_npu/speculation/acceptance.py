"""Speculative-decoding acceptance metrics as per-step deltas of the engine's monotone counters.

The engine exports cumulative counters (vLLM: ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``,
``vllm:generation_tokens``). A training step reports the difference between two snapshots:

    accept_rate        = d_accepted / d_draft_tokens
    mean_accepted_len  = 1 + d_accepted / d_drafts          (tokens emitted per verify step)
    accept_rate_pos[i] = d_accepted_pos[i] / d_drafts       (P(draft i accepted), i = 0..k-1)
    tokens_per_s       = d_generation_tokens / seconds

Counters summed over several engines give the pooled rates. A counter that goes down means the
engine restarted; the delta then restarts from zero rather than going negative. The keys a step logs
are :mod:`areal_npu.names`' (``rollout/spec_*``); every reader, the planner included, reads them as
written here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_npu import names

COUNTER_NAMES = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    """One snapshot of the cumulative counters of one engine (or a sum over engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    time: float = 0.0

    @classmethod
    def from_vllm_metrics(cls, metrics, now: float = 0.0) -> SpecCounters:
        """From ``vllm.v1.metrics.reader.get_metrics_snapshot()`` (or ``LLM.get_metrics()``); sums label sets."""
        out = cls(time=now)
        for metric in metrics:
            key = COUNTER_NAMES.get(metric.name)
            if key is not None:
                setattr(out, key, getattr(out, key) + float(metric.value))
            elif metric.name == PER_POS:
                values = [float(v) for v in metric.values]
                out.accepted_per_pos = _add_lists(out.accepted_per_pos, values)
        return out

    def to_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "generation_tokens": self.generation_tokens,
            "prompt_tokens": self.prompt_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, data: dict) -> SpecCounters:
        return cls(**{k: data[k] for k in cls().to_dict() if k in data})

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted=self.accepted + other.accepted,
            generation_tokens=self.generation_tokens + other.generation_tokens,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            accepted_per_pos=_add_lists(self.accepted_per_pos, other.accepted_per_pos),
            time=max(self.time, other.time),
        )


def _add_lists(a: list[float], b: list[float]) -> list[float]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0.0) + (b[i] if i < len(b) else 0.0) for i in range(n)]


def counter_delta(prev: SpecCounters, cur: SpecCounters) -> SpecCounters:
    """``cur - prev``; if any counter went backwards (engine restarted) the delta is ``cur`` itself."""
    scalars = ("drafts", "draft_tokens", "accepted", "generation_tokens", "prompt_tokens")
    restarted = any(getattr(cur, k) < getattr(prev, k) for k in scalars) or any(
        c < p for c, p in zip(cur.accepted_per_pos, prev.accepted_per_pos, strict=False)
    )
    if restarted:
        base = SpecCounters(time=prev.time)
    else:
        base = prev
    return SpecCounters(
        **{k: getattr(cur, k) - getattr(base, k) for k in scalars},
        accepted_per_pos=_add_lists(cur.accepted_per_pos, [-v for v in base.accepted_per_pos]),
        time=cur.time - base.time,
    )


def spec_stats(delta: SpecCounters) -> dict[str, float]:
    """The per-step metrics a trainer logs, from a counter delta (see the module docstring)."""
    stats = {
        names.SPEC_DRAFTS: delta.drafts,
        names.SPEC_DRAFT_TOKENS: delta.draft_tokens,
        names.SPEC_ACCEPTED_TOKENS: delta.accepted,
        names.SPEC_ACCEPT_RATE: delta.accepted / delta.draft_tokens if delta.draft_tokens else 0.0,
        names.SPEC_MEAN_ACCEPTED_LEN: 1.0 + delta.accepted / delta.drafts if delta.drafts else 1.0,
        names.GENERATED_TOKENS: delta.generation_tokens,
        names.TOKENS_PER_S: delta.generation_tokens / delta.time if delta.time > 0 else 0.0,
    }
    for i, value in enumerate(delta.accepted_per_pos):
        stats[names.spec_accept_rate_pos_key(i)] = value / delta.drafts if delta.drafts else 0.0
    return stats


class SpecMetricsTracker:
    """Remembers the last snapshot; ``step(cur)`` returns the stats since the previous call."""

    def __init__(self, initial: SpecCounters | None = None):
        self.last = initial

    def step(self, cur: SpecCounters) -> dict[str, float]:
        prev = self.last if self.last is not None else SpecCounters(time=cur.time)
        self.last = cur
        return spec_stats(counter_delta(prev, cur))


def request_spec_summary(per_request: list[dict]) -> dict[str, float]:
    """Pool vLLM's per-request ``spec_decode_metrics`` (summary form) over a batch of requests."""
    drafts = sum(m.get("num_spec_steps", 0) for m in per_request)
    draft_tokens = sum(m.get("num_draft_tokens", 0) for m in per_request)
    accepted = sum(m.get("num_accepted_draft_tokens", 0) for m in per_request)
    return {
        "spec_accept_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_mean_accepted_len": 1.0 + accepted / drafts if drafts else 1.0,
        "spec_drafts": float(drafts),
    }
