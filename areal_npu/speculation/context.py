"""Acceptance by context length: the context buckets (their edges live here and nowhere else), and
per-bucket, per-position counts pooled from vLLM's per-request speculative statistics.

A request's ``spec`` (vLLM's ``RequestSpecDecodeMetrics.to_dict()``, ``--per-request-spec-decode-metrics``)
holds ``acceptance_histogram[j]``: verify steps that accepted ``j`` drafts. Per bucket::

    drafts             = Σ_j hist[j]                    (verify steps that carried drafts)
    accepted           = Σ_j j · hist[j]
    accepted_pos[i]    = Σ_{j > i} hist[j]              (steps whose draft i + 1 was accepted)
    accept_rate_pos[i] = accepted_pos[i] / drafted_pos[i]   (u_i over the steps that drafted i + 1)

``drafted_pos[i]`` counts the steps that drafted position i + 1: exact in ``detailed`` mode, and in
``summary`` mode every step of a request is taken to have drafted its mean (``num_draft_tokens /
steps``); at one k per step this is the engine-wide ``rollout/spec_accept_rate_pos<i>``.

A request's context is the tokens it attends to: ``prompt + output / 2`` (the midpoint of its
generation) in ``summary`` mode; in ``detailed`` mode (``per_step_accepted``) each verify step is
bucketed by its own context ``prompt + 1 + Σ_{earlier steps} (accepted + 1)``. Our engines ask for
``summary`` (``rollout/config.py``: ``detailed`` sends two integers per verify step). vLLM 0.23 has no
per-request statistics: the buckets stay empty and nothing per bucket is logged.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from areal_npu import names

#: Upper edges (exclusive, tokens) of the context buckets; the last bucket is open.
CONTEXT_EDGES: tuple[int, ...] = (4096, 16384, 32768, 65536)


def _label(lo: int, hi: int | None) -> str:
    k = lambda n: f"{n // 1024}k"  # noqa: E731
    if lo == 0:
        return f"lt{k(hi)}"
    return f"ge{k(lo)}" if hi is None else f"{k(lo)}_{k(hi)}"


#: ``lt4k``, ``4k_16k``, ``16k_32k``, ``32k_64k``, ``ge64k``: the names the metric keys carry.
BUCKET_LABELS: tuple[str, ...] = tuple(
    _label(lo, hi) for lo, hi in zip((0, *CONTEXT_EDGES), (*CONTEXT_EDGES, None), strict=True)
)


def context_bucket(tokens: float) -> int:
    """Index into :data:`BUCKET_LABELS` of a context of ``tokens`` tokens (bucket i = [edge i-1, edge i))."""
    return bisect.bisect_right(CONTEXT_EDGES, tokens)


def bucket_mid(i: int) -> float:
    """A representative context of bucket i (its middle; the open last bucket: 1.5 × its lower edge)."""
    lo = 0 if i == 0 else CONTEXT_EDGES[i - 1]
    return (lo + CONTEXT_EDGES[i]) / 2 if i < len(CONTEXT_EDGES) else 1.5 * lo


@dataclass
class BucketCounts:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_pos: list[int] = field(default_factory=list)  # steps whose draft i + 1 was accepted
    drafted_pos: list[int] = field(default_factory=list)  # steps that drafted position i + 1

    def add_step(self, accepted: int, drafted: int) -> None:
        """One verify step that drafted ``drafted`` tokens and accepted the first ``accepted``."""
        self.add_histogram([0] * accepted + [1], drafted, drafted)

    def add_histogram(self, histogram: Sequence[int], draft_tokens: int, drafted: int | None = None) -> None:
        """Steps ``histogram[j]`` accepting ``j`` drafts, each drafting ``drafted`` tokens (default: the
        mean, ``draft_tokens / steps`` rounded: summary statistics do not say how many each step drafted)."""
        hist = [int(h) for h in histogram]
        steps = sum(hist)
        if drafted is None:
            drafted = round(draft_tokens / steps) if steps else 0
        self.drafts += steps
        self.draft_tokens += int(draft_tokens)
        self.accepted += sum(j * h for j, h in enumerate(hist))
        depth = max(len(hist) - 1, drafted)
        self.accepted_pos = _add(self.accepted_pos, [sum(hist[i + 1 :]) for i in range(depth)])
        self.drafted_pos = _add(self.drafted_pos, [steps if i < drafted else 0 for i in range(depth)])

    def accept_per_pos(self) -> list[float]:
        """``u_i``: of the steps that drafted position i + 1, the fraction that accepted it; up to the
        deepest position drafted."""
        return [a / d for a, d in zip(self.accepted_pos, self.drafted_pos, strict=True) if d]


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def add_request(buckets: dict[int, BucketCounts], spec: Mapping, prompt_len: int, output_len: int) -> None:
    """Add one sample's ``spec`` (see the module docstring) to ``buckets`` (index -> counts)."""
    steps = spec.get("per_step_accepted")
    if steps:
        drafted = spec.get("per_step_drafted") or [len(spec.get("acceptance_histogram", [])) - 1] * len(steps)
        context = prompt_len + 1
        for accepted, n in zip(steps, drafted, strict=False):
            buckets.setdefault(context_bucket(context), BucketCounts()).add_step(int(accepted), int(n))
            context += int(accepted) + 1
        return
    hist = spec.get("acceptance_histogram")
    if not hist:
        return
    bucket = context_bucket(prompt_len + output_len / 2)
    buckets.setdefault(bucket, BucketCounts()).add_histogram(hist, spec.get("num_draft_tokens", 0))


def bucket_stats(buckets: Mapping[int, BucketCounts]) -> dict[str, float]:
    """``rollout/spec_ctx_<bucket>_{drafts, accept_rate, mean_accepted_len, accept_rate_pos<i>}``
    of every bucket that carried drafts."""
    out: dict[str, float] = {}
    for i, c in sorted(buckets.items()):
        if not c.drafts:
            continue
        label = BUCKET_LABELS[i]
        out[names.spec_ctx_key(label, "drafts")] = float(c.drafts)
        out[names.spec_ctx_key(label, "accept_rate")] = c.accepted / c.draft_tokens if c.draft_tokens else 0.0
        out[names.spec_ctx_key(label, "mean_accepted_len")] = 1.0 + c.accepted / c.drafts
        for pos, u in enumerate(c.accept_per_pos()):
            out[names.spec_ctx_key(label, f"accept_rate_pos{pos}")] = u
    return out


def accept_by_bucket(stats: Mapping[str, float]) -> dict[str, list[float]]:
    """Bucket label -> ``[u_0, u_1, ...]`` read back from one step's stats (or a metrics row)."""
    out: dict[str, list[float]] = {}
    for label in BUCKET_LABELS:
        u, pos = [], 0
        while (key := names.spec_ctx_key(label, f"accept_rate_pos{pos}")) in stats:
            u.append(float(stats[key]))
            pos += 1
        if u:
            out[label] = u
    return out


def pooled_by_bucket(rows: Iterable[Mapping]) -> dict[str, dict[str, float]]:
    """Bucket label -> stat (``accept_rate_pos<i>``, ``accept_rate``, ``mean_accepted_len``; ``drafts``:
    their sum) over ``metrics.jsonl`` rows, each step weighted by the drafts it verified in the bucket;
    buckets with data, in order."""
    rx = re.compile(names.SPEC_CTX_PATTERN)
    sums: dict[str, dict[str, float]] = {}
    for row in rows:
        for key, v in row.items():
            m = rx.fullmatch(key)
            if not m or m.group(2) == "k" or not _finite(v):
                continue
            label, stat = m.groups()
            w = 1.0 if stat == "drafts" else row.get(names.spec_ctx_key(label, "drafts"), 0.0)
            if not _finite(w) or w <= 0:
                continue
            acc = sums.setdefault(label, {})
            acc[stat] = acc.get(stat, 0.0) + w * v
            acc["_w_" + stat] = acc.get("_w_" + stat, 0.0) + w
    out = {}
    for label in BUCKET_LABELS:
        if label in sums:
            acc = sums[label]
            out[label] = {s: acc[s] / acc["_w_" + s] for s in acc if not s.startswith("_w_")}
            if "drafts" in acc:
                out[label]["drafts"] = acc["drafts"]
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def token_mix(pooled: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Share of the generated tokens per bucket (drafts × mean accepted length) from :func:`pooled_by_bucket`."""
    tokens = {b: s.get("drafts", 0.0) * s.get("mean_accepted_len", 1.0) for b, s in pooled.items()}
    total = sum(tokens.values())
    return {b: t / total for b, t in tokens.items()} if total > 0 else {}


class ContextAcceptance:
    """Pools the samples' ``spec`` between two calls of :meth:`step` (the rollout client feeds it)."""

    def __init__(self):
        self.buckets: dict[int, BucketCounts] = {}

    def add(self, spec: Mapping | None, prompt_len: int, output_len: int) -> None:
        if spec:
            add_request(self.buckets, spec, prompt_len, output_len)

    def step(self) -> dict[str, float]:
        """The per-bucket stats since the previous call."""
        stats, self.buckets = bucket_stats(self.buckets), {}
        return stats
