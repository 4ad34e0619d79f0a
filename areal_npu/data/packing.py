"""Micro-batch planning for THD sequence packing.

A *plan* is a list of micro-batches, each a list of sample indices into the step's batch. Planning
is pure (lengths in, index lists out) except :func:`plan_micro_batches`, which agrees on the number
of micro-batches with the other data-parallel ranks through ``all_reduce(MAX)``.

Formulas used throughout:

- lower bound on micro-batches: ``L = ceil(sum_i s_i / cap)``;
- attention cost of a sequence of ``s`` tokens: ``cost(s) = s**2 + c * s`` (``c`` = ``cost_linear_coef``,
  roughly ``6 * hidden_size``: MLP and projection FLOPs per token relative to attention's per pair);
- utilization of a micro-batch layout: ``sum_i s_i / slots``.

The physical layout of one micro-batch (concatenated tokens, ``cu_seqlens``, positions, alignment
segment) lives in :mod:`areal_npu.data.packed_layout`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from areal_npu import names

__all__ = [
    "PackingConfig",
    "attention_cost",
    "balance_across_ranks",
    "check_lengths",
    "cp_padded_length",
    "ffd_pack",
    "kk_partition",
    "lower_bound_micro_batches",
    "packing_stats",
    "pack_to_count",
    "plan_micro_batches",
    "restore_order",
    "sync_micro_batch_count",
]


@dataclass
class PackingConfig:
    """How a step's sequences become micro-batches.

    max_tokens_per_mb: hard cap on the slots of one micro-batch: real tokens plus the per-sequence
        context-parallel padding (each sequence rounded up to a multiple of ``2 * cp``); since the cap
        is a multiple of the alignment, the trailing alignment segment never pushes a micro-batch
        past it either.
    mode: ``"ffd"`` (First-Fit-Decreasing, fewest micro-batches) or ``"kk"`` (Karmarkar-Karp largest
        differencing: token sums balanced across micro-batches, count grown until the cap holds).
    min_mbs: at least this many micro-batches (e.g. pipeline stages need several).
    mbs_divisor: the count is rounded up to a multiple of this (e.g. pipeline-parallel size).
    on_too_long: a sequence longer than the cap is an ``"error"`` (naming the sample and both
        lengths) or ``"truncate"``: the plan counts ``min(s, cap)`` tokens and the caller keeps the
        first ``cap`` tokens of that sequence (its loss mask cut alike).
    tp_size, cp_size: alignment of the packed length: a multiple of ``tp`` or ``2 * tp * cp``; a
        recipe derives them from ``train.megatron.tp_size`` / ``cp_size`` (1 with FSDP2).
    cost_linear_coef: ``c`` in ``cost(s) = s**2 + c * s``, which balances the micro-batches when their
        count is forced above the plan's own (several data-parallel ranks, ``min_mbs``, ``mbs_divisor``).
    """

    max_tokens_per_mb: int = 8192
    mode: str = "ffd"
    min_mbs: int = 1
    mbs_divisor: int = 1
    on_too_long: str = "error"
    tp_size: int = 1
    cp_size: int = 1
    cost_linear_coef: float = 24576.0

    def validate(self) -> PackingConfig:
        """Raise ValueError naming the first bad key; return self."""
        if not isinstance(self.max_tokens_per_mb, int) or self.max_tokens_per_mb <= 0:
            raise ValueError(f"max_tokens_per_mb must be a positive int, got {self.max_tokens_per_mb!r}")
        if self.mode not in ("ffd", "kk"):
            raise ValueError(f"mode must be 'ffd' or 'kk', got {self.mode!r}")
        for key in ("min_mbs", "mbs_divisor", "tp_size", "cp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        if self.on_too_long not in ("error", "truncate"):
            raise ValueError(f"on_too_long must be 'error' or 'truncate', got {self.on_too_long!r}")
        if self.cost_linear_coef < 0:
            raise ValueError(f"cost_linear_coef must be >= 0, got {self.cost_linear_coef!r}")
        if self.max_tokens_per_mb % self.alignment:
            raise ValueError(
                f"max_tokens_per_mb ({self.max_tokens_per_mb}) must be a multiple of the alignment "
                f"{self.alignment} (tp_size * (2 * cp_size if cp_size > 1 else 1))"
            )
        return self

    @property
    def alignment(self) -> int:
        """Packed length multiple: ``tp`` without context parallelism, ``2 * tp * cp`` with it."""
        return self.tp_size * (2 * self.cp_size if self.cp_size > 1 else 1)


def check_lengths(lengths: Sequence[int], cap: int, on_too_long: str = "error") -> list[int]:
    """Validate lengths; return them (clipped to ``cap`` when ``on_too_long == "truncate"``)."""
    if len(lengths) == 0:
        raise ValueError("cannot plan an empty batch: no sequences were given")
    out = []
    for i, s in enumerate(lengths):
        s = int(s)
        if s <= 0:
            raise ValueError(f"sample {i} has non-positive length {s}")
        if s > cap:
            if on_too_long != "truncate":
                raise ValueError(
                    f"sample {i} has length {s} > max_tokens_per_mb {cap}; raise the cap or set "
                    "on_too_long='truncate'"
                )
            s = cap
        out.append(s)
    return out


def lower_bound_micro_batches(lengths: Sequence[int], cap: int) -> int:
    """``L = ceil(sum_i s_i / cap)``: no plan under the cap uses fewer micro-batches."""
    return -(-sum(int(s) for s in lengths) // cap)


def attention_cost(s: int, linear_coef: float) -> float:
    """``cost(s) = s**2 + c * s``: causal attention pairs (x2) plus per-token linear work."""
    return float(s) * float(s) + linear_coef * float(s)


def ffd_pack(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """First-Fit-Decreasing: sort by length descending, put each into the first bin it fits.

    Uses a max segment tree over bins' free space so each placement is ``O(log B)``; the result uses
    at most ``11/9 * OPT + 6/9`` bins (Dosa 2007). Returns index lists in the order bins were opened.
    """
    lengths = check_lengths(lengths, cap)
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    # Any-fit leaves at most one bin half empty, so B < 2 * sum / cap + 1: a tree that size suffices.
    size = 1
    while size < min(len(lengths), 2 * lower_bound_micro_batches(lengths, cap) + 1):
        size *= 2
    tree = [0] * (2 * size)  # free space; leaves at [size, 2*size), unopened bins have 0
    bins: list[list[int]] = []
    for i in order:
        s = lengths[i]
        if tree[1] < s:  # fits nowhere: open a new bin
            node = size + len(bins)
            bins.append([i])
            value = tree[node] = cap - s
            node //= 2
            while node and tree[node] < value:  # raise ancestors until one already covers it
                tree[node] = value
                node //= 2
        else:
            node = 1
            while node < size:
                node *= 2
                if tree[node] < s:
                    node += 1
            bins[node - size].append(i)
            tree[node] -= s
            node //= 2
            while node:  # lower ancestors while their max changes
                left, right = tree[2 * node], tree[2 * node + 1]
                value = left if left > right else right
                if tree[node] == value:
                    break
                tree[node] = value
                node //= 2
    return bins


def kk_partition(weights: Sequence[float], k: int) -> list[list[int]]:
    """Karmarkar-Karp largest differencing into ``k`` sets with balanced weight sums.

    Each item starts as a k-tuple of sets (itself plus k-1 empty sets); repeatedly the two tuples
    with the largest spread (max sum - min sum) are merged, pairing the heaviest set of one with
    the lightest of the other. ``O(n log n + n k log k)``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    heap = []
    for i, w in enumerate(weights):
        sets = [(float(w), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(w), i, sets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, tie_a, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda t: t[0], reverse=True)
        b.sort(key=lambda t: t[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        sums = [t[0] for t in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie_a, merged))
    return [sorted(items) for _, items in heap[0][2]]


def pack_to_count(lengths: Sequence[int], cap: int, count: int, linear_coef: float = 0.0) -> list[list[int]]:
    """Exactly ``count`` micro-batches under ``cap``, balanced by ``cost(s) = s**2 + c * s``.

    Longest-processing-time first: by cost descending, each sequence goes to the cheapest
    micro-batch it fits in. If that ever fails, falls back to the FFD bins (always feasible when
    ``count`` >= their number) and fills the missing ones by moving single sequences out of the
    fullest multi-sequence bins. Micro-batches can be empty when there are fewer sequences than
    ``count``; the caller then runs an alignment-only micro-batch.
    """
    lengths = check_lengths(lengths, cap)
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    tokens = [0] * count
    costs = [(0.0, b) for b in range(count)]  # heap of (cost, bin)
    bins: list[list[int]] = [[] for _ in range(count)]
    feasible = True
    for i in order:
        s = lengths[i]
        skipped = []
        while costs and tokens[costs[0][1]] + s > cap:
            skipped.append(heapq.heappop(costs))
        if not costs:
            feasible = False
            break
        c, b = heapq.heappop(costs)
        bins[b].append(i)
        tokens[b] += s
        heapq.heappush(costs, (c + attention_cost(s, linear_coef), b))
        for item in skipped:
            heapq.heappush(costs, item)
    if feasible:
        return bins
    bins = ffd_pack(lengths, cap)
    if len(bins) > count:
        raise ValueError(f"cannot fit {len(lengths)} sequences into {count} micro-batches under cap {cap}")
    while len(bins) < count:
        multi = [b for b in bins if len(b) > 1]
        if not multi:
            bins.append([])
            continue
        donor = max(multi, key=lambda b: sum(lengths[i] for i in b))
        bins.append([donor.pop()])
    return bins


def sync_micro_batch_count(count: int, group=None) -> int:
    """``max`` of ``count`` over the data-parallel ``group`` (all_reduce MAX); ``count`` alone when
    torch.distributed is not initialised. Works with gloo (CPU tensor)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(count)
    device = torch.device("cpu")
    if dist.get_backend(group) != "gloo":  # nccl / hccl reduce device tensors only
        from areal_npu.platform import current_platform

        module = current_platform().torch_module()
        if module is not None:
            device = current_platform().device(module.current_device())
    t = torch.tensor([int(count)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cp_padded_length(s: int, cp_size: int) -> int:
    """Slots a sequence of ``s`` tokens takes in a packed micro-batch: ``s`` without context
    parallelism, ``round_up(s, 2 * cp)`` with it (it must split into ``2 * cp`` equal chunks)."""
    return _round_up(int(s), 2 * cp_size) if cp_size > 1 else int(s)


def plan_micro_batches(lengths: Sequence[int], config: PackingConfig, group=None) -> list[list[int]]:
    """Plan this rank's micro-batches; every rank in ``group`` gets the same count.

    count = round_up(max(max over ranks of local_count, min_mbs), mbs_divisor), where local_count is
    the FFD bin count (mode "ffd") or the smallest k >= L whose KK partition fits the cap (mode
    "kk"). If the agreed count is above the local one, the rank re-plans with
    :func:`pack_to_count`. Sequences are planned at their packed size :func:`cp_padded_length`, so
    every micro-batch's packed layout holds at most ``max_tokens_per_mb`` slots.
    """
    config.validate()
    cap = config.max_tokens_per_mb
    lengths = check_lengths(lengths, cap, config.on_too_long)
    # The packed layout pads every sequence to a multiple of 2 * cp inside its own segment; those
    # slots cost memory and compute like real tokens, so the cap must count them.
    lengths = [cp_padded_length(s, config.cp_size) for s in lengths]
    if config.mode == "ffd":
        local = ffd_pack(lengths, cap)
    else:
        local = _kk_fit(lengths, cap, max(lower_bound_micro_batches(lengths, cap), config.min_mbs))
    count = sync_micro_batch_count(len(local), group)
    count = _round_up(max(count, config.min_mbs), config.mbs_divisor)
    if count == len(local):
        return local
    if config.mode == "kk":
        plan = kk_partition(lengths, count)
        if max(sum(lengths[i] for i in b) for b in plan) <= cap:
            return plan
    return pack_to_count(lengths, cap, count, config.cost_linear_coef)


def _kk_fit(lengths: list[int], cap: int, k: int) -> list[list[int]]:
    """Smallest ``k' >= k`` whose KK partition fits the cap (FFD's count always does with LPT)."""
    ffd_count = len(ffd_pack(lengths, cap))
    while k < ffd_count:
        plan = kk_partition(lengths, k)
        if max(sum(lengths[i] for i in b) for b in plan) <= cap:
            return plan
        k += 1
    plan = kk_partition(lengths, k)
    if max(sum(lengths[i] for i in b) for b in plan) <= cap:
        return plan
    return pack_to_count(lengths, cap, k)


def balance_across_ranks(
    lengths: Sequence[int], dp_size: int, linear_coef: float = 24576.0
) -> list[list[int]]:
    """Split one global batch across ``dp_size`` ranks with balanced ``sum_i cost(s_i)``
    (KK on ``cost(s) = s**2 + c * s``), so a rank holding one 64K trajectory is not also given
    as many tokens of short ones as the others."""
    if len(lengths) == 0:
        raise ValueError("cannot balance an empty batch across ranks")
    for i, s in enumerate(lengths):
        if int(s) <= 0:
            raise ValueError(f"sample {i} has non-positive length {s}")
    return kk_partition([attention_cost(int(s), linear_coef) for s in lengths], dp_size)


def restore_order(plan: Sequence[Sequence[int]]) -> list[int]:
    """Indices ``r`` with ``flat[r[j]]`` = output of sample ``j``, where ``flat`` concatenates the
    per-sample outputs in plan order (micro-batch by micro-batch). ``r = argsort(concat(plan))``."""
    flat = [i for mb in plan for i in mb]
    inverse = [0] * len(flat)
    for pos, i in enumerate(flat):
        inverse[i] = pos
    return inverse


def packing_stats(
    lengths: Sequence[int],
    plan: Sequence[Sequence[int]],
    cap: int,
    alignment_pad_tokens: int = 0,
) -> dict[str, float]:
    """Per-step packing metrics (floats).

    utilization = real / (real + alignment padding): the slots a THD micro-batch computes on;
    cap_fill = real / (count * cap): how full the micro-batches are against the cap;
    padded_utilization = real / (n * max_len): the same sequences as one padded [n, max_len] batch.
    """
    real = sum(int(s) for s in lengths)
    count = len(plan)
    per_mb = [sum(int(lengths[i]) for i in mb) for mb in plan]
    lb = lower_bound_micro_batches(lengths, cap)
    return {
        names.PACKING_REAL_TOKENS: float(real),
        names.PACKING_SLOTS: float(real + alignment_pad_tokens),
        names.PACKING_UTILIZATION: real / (real + alignment_pad_tokens) if real else 0.0,
        names.PACKING_CAP_FILL: real / (count * cap) if count else 0.0,
        names.PACKING_PADDED_SLOTS: float(len(lengths) * max(lengths)) if lengths else 0.0,
        names.PACKING_PADDED_UTILIZATION: real / (len(lengths) * max(lengths)) if lengths else 0.0,
        names.PACKING_ALIGNMENT_PAD_TOKENS: float(alignment_pad_tokens),
        names.PACKING_MICRO_BATCHES: float(count),
        names.PACKING_MICRO_BATCHES_LOWER_BOUND: float(lb),
        names.PACKING_MICRO_BATCHES_OVER_BOUND: float(count - lb),
        names.PACKING_TOKENS_PER_MB_MEAN: real / count if count else 0.0,
        names.PACKING_TOKENS_PER_MB_MAX: float(max(per_mb, default=0)),
        names.PACKING_TOKENS_PER_MB_MIN: float(min(per_mb, default=0)),
        names.PACKING_SEQUENCES: float(len(lengths)),
        names.PACKING_MAX_SEQLEN: float(max(lengths, default=0)),
        names.PACKING_MEAN_SEQLEN: real / len(lengths) if lengths else 0.0,
        names.PACKING_ATTENTION_COST_RATIO: _cost_ratio(lengths, plan),
    }


def _cost_ratio(lengths: Sequence[int], plan: Sequence[Sequence[int]]) -> float:
    """max / mean of per-micro-batch ``sum s_i**2`` (1.0 = perfectly balanced attention work)."""
    costs = [sum(float(lengths[i]) ** 2 for i in mb) for mb in plan]
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean else 1.0
