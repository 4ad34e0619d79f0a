"""Several trainer ranks under one controller: rank 0 leads, the other ranks follow.

The controller (rollouts, rewards, the rollout engines, weight sync, metrics) runs once, on rank
0. Its train engine is a :class:`LeaderEngine`: every collective call it makes is first sent to
the other ranks, which run :func:`follow` and make the same call on their own engine. So the
controller stays a one-process program and every rank still calls every engine method in the same
order (:mod:`areal_npu.train.protocol`), with its own share of the batch for the data-carrying ones
(:func:`shard_indices`). A share goes to each *data-parallel* rank (:func:`data_rank`): with
FSDP2 every rank; with Megatron the ranks of one TP x CP group are one data rank and get the same
samples, as its engine requires. Weights are exported once per update: every rank iterates
``export_buckets`` (FSDP2's full-tensor gathers and Megatron's TP gathers are collective) and only
rank 0's buckets are pushed.

Commands travel over a gloo group of their own (objects on the CPU, whatever the training
backend). Why no hang: a rank that dies closes its sockets, so a peer waiting in a collective with
it fails at once; a rank that lives but stops answering fails its peers after the group's timeout
(:data:`FOLLOWER_WAIT_S` for commands, the default group's for training collectives). Rank 0 sends
``stop`` on every exit path, with the error when it failed, and the followers return.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES

__all__ = [
    "FOLLOWER_WAIT_S",
    "LeaderEngine",
    "RankChannel",
    "data_rank",
    "follow",
    "pin_trainer_cores",
    "shard_indices",
]

#: How long a follower waits for rank 0's next command (rollouts, evals and engine start-up run in
#: between) before it gives up. A dead rank 0 is noticed at once (closed sockets); this bounds a
#: rank 0 that lives but hangs.
FOLLOWER_WAIT_S = 3600.0
#: How long rank 0 waits to hand ``stop`` to the followers after a failure before it exits anyway.
STOP_WAIT_S = 30.0
STOP = "stop"


def shard_indices(count: int, world: int, minibatches: int = 1) -> list[list[int]]:
    """Each rank's sample indices of a batch of ``count``, in the order the rank passes them.

    ``train_step`` splits a rank's samples into PPO mini-batches ``local[i::minibatches]``; the
    order here makes rank ``r``'s mini-batch ``i`` its part (every ``world``-th sample) of the
    global mini-batch ``i`` one rank would take (``samples[i::minibatches]``), so ``world`` ranks
    take the same optimizer steps as one. Needs ``count`` divisible by ``world * minibatches``."""
    if world < 1 or minibatches < 1 or count % (world * minibatches):
        raise ValueError(f"{count} samples do not split into {world} ranks x {minibatches} mini-batches")
    per_part = count // (world * minibatches)
    out = []
    for rank in range(world):
        parts = [list(range(i, count, minibatches))[rank::world] for i in range(minibatches)]
        out.append([parts[i][k] for k in range(per_part) for i in range(minibatches)])
    return out


def data_rank(engine) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process's ``engine``: which share of a batch
    it takes. An engine with a ``dp_group`` (Megatron: its TP x CP peers are one data rank, in the
    group of the ranks that hold other samples) answers from it; otherwise (FSDP2) every rank is one."""
    group = getattr(engine, "dp_group", None)
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return dist.get_rank(group), dist.get_world_size(group)


class RankChannel:
    """Rank 0 -> followers commands and followers -> rank 0 results, as pickled objects over a gloo
    group of their own with timeout ``timeout_s``. Collective to build (every rank of the default
    group): each rank tells rank 0 its ``data`` rank (:func:`data_rank`; default: its own rank of
    ``world``), kept as ``data_ranks`` (one per rank, on rank 0) and ``data_world``."""

    def __init__(self, timeout_s: float = FOLLOWER_WAIT_S, data: tuple[int, int] | None = None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        data = (self.rank, self.world) if data is None else tuple(data)
        gathered = self.gather(data)
        self.data_ranks, self.data_world = None, data[1]
        if gathered is not None:
            self.data_ranks = [r for r, _ in gathered]
            if {w for _, w in gathered} != {data[1]} or set(self.data_ranks) != set(range(data[1])):
                raise RuntimeError(f"trainer ranks report inconsistent data-parallel ranks: {gathered}")

    def scatter(self, per_rank: list | None):
        """Rank 0 passes one object per rank and gets its own back; the others get theirs."""
        out = [None]
        dist.scatter_object_list(out, per_rank if self.rank == 0 else None, src=0, group=self.group)
        return out[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (rank order); ``None`` elsewhere."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


class LeaderEngine:
    """Rank 0's view of the trainer: a :class:`~areal_npu.train.protocol.TrainEngine` that runs each
    call on every rank. ``compute_logprobs`` and ``train_step`` / ``forward_backward`` take the
    whole batch and hand each data rank its share (the same share to ranks of one data rank); the
    log-probs come back in the batch's order. The batch must split evenly over the data ranks
    (:func:`shard_indices`; ``check_trainer`` refuses a recipe whose does not)."""

    def __init__(self, engine, channel: RankChannel, minibatches: int = 1):
        self.engine, self.channel, self.minibatches = engine, channel, minibatches
        self.stopped = False

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def mtp(self):
        return self.engine.mtp

    def _send(self, name: str, *args) -> None:
        self.channel.scatter([(name, args)] * self.channel.world)

    def _send_shards(self, name: str, samples: Sequence, minibatches: int, *rest) -> tuple[list, list]:
        """Each rank's sample indices (its data rank's share) and rank 0's own samples, sent."""
        shards = shard_indices(len(samples), self.channel.data_world, minibatches)
        per_rank = [shards[d] for d in self.channel.data_ranks]
        own = self.channel.scatter([(name, ([samples[i] for i in idx], *rest)) for idx in per_rank])
        return per_rank, own[1][0]

    def compute_logprobs(self, samples):
        per_rank, own = self._send_shards("compute_logprobs", samples, 1)
        mine = self.engine.compute_logprobs(own)
        out = [None] * len(samples)
        for idx, logps in zip(per_rank, self.channel.gather(mine)):
            for i, lp in zip(idx, logps):
                if out[i] is None:  # TP/CP peers return the same log-probs: the first is kept
                    out[i] = lp
        return out

    def train_step(self, samples, loss, step=None):
        _, own = self._send_shards("train_step", samples, self.minibatches, loss, step)
        return self.engine.train_step(own, loss, step)

    def forward_backward(self, samples, loss, step=None):
        _, own = self._send_shards("forward_backward", samples, 1, loss, step)
        return self.engine.forward_backward(own, loss, step)

    def optimizer_step(self, step=None, bump_version=True):
        self._send("optimizer_step", step, bump_version)
        return self.engine.optimizer_step(step, bump_version)

    def full_state_dict(self):
        self._send("full_state_dict")
        yield from self.engine.full_state_dict()

    def export_buckets(self, bucket_bytes=DEFAULT_BUCKET_BYTES, kinds=("policy", "mtp")):
        self._send("export_buckets", bucket_bytes, tuple(kinds))
        yield from self.engine.export_buckets(bucket_bytes, kinds)

    def save_checkpoint(self, root, extra=None, tokenizer=None, keep_last=2):
        self._send("save_checkpoint", root, extra, None, keep_last)
        return self.engine.save_checkpoint(root, extra, tokenizer, keep_last)

    def load_checkpoint(self, path):
        self._send("load_checkpoint", path)
        return self.engine.load_checkpoint(path)

    def save_hf_checkpoint(self, out_dir, tokenizer=None):
        self._send("save_hf_checkpoint", out_dir, None)
        return self.engine.save_hf_checkpoint(out_dir, tokenizer)

    def stop(self, error: BaseException | None = None) -> None:
        """Tell the followers to return (once). After a failure rank 0 may be out of step with
        them (mid-collective); then the send is bounded by :data:`STOP_WAIT_S` and rank 0 moves on:
        its exit closes the sockets a stuck follower waits on."""
        if self.stopped:
            return
        self.stopped = True
        reason = None if error is None else f"{type(error).__name__}: {error}"
        if error is None:
            self._send(STOP, reason)
            return
        import threading

        def send() -> None:
            with contextlib.suppress(Exception):  # a follower that is gone needs no stop
                self._send(STOP, reason)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(STOP_WAIT_S)


def follow(engine, channel: RankChannel) -> str | None:
    """A follower rank's loop: run rank 0's commands on ``engine`` until ``stop``; returns rank 0's
    error (``None`` after a clean run). A failure here raises, and the process exits with it."""
    while True:
        name, args = channel.scatter(None)
        if name == STOP:
            return args[0]
        if name == "compute_logprobs":
            channel.gather(engine.compute_logprobs(*args))
        elif name in ("export_buckets", "full_state_dict"):
            for _ in getattr(engine, name)(*args):  # collective gathers; rank 0 pushes
                pass
        elif name in ("train_step", "forward_backward", "optimizer_step", "save_checkpoint",
                      "load_checkpoint", "save_hf_checkpoint"):  # fmt: skip
            getattr(engine, name)(*args)
        else:
            raise RuntimeError(f"unknown command from rank 0: {name!r}")


def trainer_cores(cfg, rank: int) -> list[int] | None:
    """On the CPU, the cores the placement plan gives trainer ``rank`` on this machine (planned
    from this process's affinity, before any narrowing); ``None`` elsewhere."""
    if cfg.device != "cpu":
        return None
    from areal_npu import placement
    from areal_npu.platform import CPU_AFFINITY_ENV, parse_id_list

    plan = placement.plan_recipe(cfg, placement.describe_cluster("cpu"))
    proc = next(p for p in plan.processes if p.role == "trainer" and p.rank == rank)
    return parse_id_list(proc.env[CPU_AFFINITY_ENV])


def pin_trainer_cores(cores: list[int] | None) -> None:
    """Bind this process (threads started from now on) to ``cores`` and size torch's pool to them."""
    if not cores:
        return
    import torch

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


@contextlib.contextmanager
def cpu_affinity(cores: set[int] | None):
    """This thread's affinity set to ``cores`` for the block (the engines rank 0 starts then split
    the machine's cores, not rank 0's own), restored afterwards."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
