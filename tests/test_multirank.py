"""Several trainer ranks under one controller (:mod:`areal_npu.train.ranks`), against a one-rank run.

The loop runs at the controller seam with real FSDP2 engines over gloo and a recorded rollout
side (a workflow whose trajectories depend on the group index alone, a weight sync that records
what it was pushed), so one rank and two ranks train on the same data. References: the 1-rank
run's final weights, step metrics and pushed-weight checksums; for failures, that the other rank
stops with the error instead of waiting.
"""

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from areal_npu import names
from areal_npu.train.ranks import shard_indices
from tests.support.ranks import run_ranks

STEPS = 3
#: the step stats that are global (reduced over ranks); packing/* and timings are per rank
COMPARED = ("ppo/", "train/", "reward/", "mtp/", "grpo/", "adv/")


@pytest.mark.parametrize(
    "count, world, minibatches", [(8, 2, 1), (8, 2, 2), (12, 3, 2), (16, 4, 4), (6, 1, 3)]
)
def test_shards_make_each_global_minibatch_of_one_rank(count, world, minibatches):
    shards = shard_indices(count, world, minibatches)
    assert sorted(i for s in shards for i in s) == list(range(count))  # a partition
    for i in range(minibatches):  # rank r's mini-batch i, over all ranks: one rank's mini-batch i
        union = sorted(j for s in shards for j in s[i::minibatches])
        assert union == list(range(count))[i::minibatches]


def test_shards_refuse_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="do not split"):
        shard_indices(10, 4, 1)


class _Workflow:
    """Trajectories from the group index alone: both runs train on the same data."""

    async def run(self, task, client, group_id):
        from areal_npu.data.trajectory import Trajectory

        await asyncio.sleep(0)
        g = torch.Generator().manual_seed(group_id)
        out = []
        for k in range(4):
            prompt = torch.randint(3, 300, (3 + (group_id + k) % 3,), generator=g).tolist()
            response = torch.randint(3, 300, (4 + k,), generator=g).tolist()
            behave = (-4.0 + 0.5 * torch.randn(len(response), generator=g)).tolist()
            out.append(Trajectory(prompt, response, behave, [0] * len(response), reward=float((group_id + k) % 3),
                                  group_id=group_id))  # fmt: skip
        return out


class _Client:
    generation = (0,)  # restarts per engine (RolloutClient's)

    async def step_metrics(self):
        return {}


class _Sync:
    """Records the version and a float64 checksum of every push; fails the push of ``fail_at``."""

    def __init__(self, fail_at=None):
        self.pushed, self.fail_at = [], fail_at

    async def push(self, named, version, sync_draft=True):
        if version == self.fail_at:
            raise RuntimeError(f"push of version {version} failed on purpose")
        named = list(named)  # the trainer's export, streamed: drawn here (collective on every rank)
        self.pushed.append((version, sum(float(t.double().sum()) for _, t in named), len(named)))


class _Logger:
    def log(self, step, stats):
        pass

    def print(self, *args):
        pass


class _FailingEngine:
    """A follower's engine that fails its ``fail_at``-th train step."""

    def __init__(self, engine, fail_at):
        self.engine, self.fail_at, self.calls = engine, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def train_step(self, samples, loss, step=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("follower fails on purpose")
        return self.engine.train_step(samples, loss, step)


def _engine():
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.model.tiny import TinyModelConfig, build_tiny_model
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.optim import OptimConfig

    tiny = TinyModelConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, layout="text", linear_attention_every=0,
                           mtp_num_hidden_layers=1, seed=5)  # fmt: skip
    lm, head, _ = build_tiny_model(tiny)
    cfg = TrainEngineConfig(ppo_minibatches=2, optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    cfg.packing.max_tokens_per_mb = 40
    return FSDPEngine(lm, head, cfg, mtp_config=MTPConfig(enabled=True, train=True))


def _controller_run(rank, world, engine, channel, out_dir, fail_push_at=None, fail_follower_at=None):
    """One run of the loop: rank 0 leads (its result or error in ``out_dir``), the others follow."""
    from areal_npu.algo.advantages import GRPOConfig
    from areal_npu.controller import ControllerConfig, RLController
    from areal_npu.speculation.config import SpecConfig
    from areal_npu.train.losses import PPOLoss
    from areal_npu.train.ranks import LeaderEngine, follow

    out_dir.mkdir(exist_ok=True)
    if rank != 0:
        if fail_follower_at is not None:
            engine = _FailingEngine(engine, fail_follower_at)
        reason = follow(engine, channel)
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"stopped_by": reason}))
        return
    leader = LeaderEngine(engine, channel, minibatches=2) if world > 1 else engine
    sync = _Sync(fail_at=fail_push_at)
    controller = RLController(
        ControllerConfig(steps=STEPS, batch_groups=2, max_staleness=STEPS, checkpoint_every=2),
        leader, None, _Client(), list(range(64)), out_dir, _Logger(), spec=SpecConfig(), grpo=GRPOConfig(),
        loss=PPOLoss(), seed=0, weight_sync=sync,
    )  # fmt: skip
    error = None
    try:
        history = asyncio.run(controller.run(_Workflow()))
        weights = dict(leader.full_state_dict())
    except Exception as exc:
        error = exc
        (out_dir / "rank0.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    finally:
        if world > 1:
            leader.stop(error)
    stats = [{k: v for k, v in h.items() if k.startswith(COMPARED)} for h in history]
    torch.save({"stats": stats, "pushed": sync.pushed, "weights": weights}, out_dir / "result.pt")


def _worker(rank, world, init_file, out_dir, mode):
    from areal_npu.train.dist import process_group
    from areal_npu.train.ranks import RankChannel

    with process_group(rank, world, f"file://{init_file}"):
        torch.manual_seed(0)
        engine = _engine()
        channel = RankChannel(timeout_s=300) if world > 1 else None
        if mode != "failures":
            _controller_run(rank, world, engine, channel, out_dir)
            return
        # rank 0 fails: the followers return with its error, and every rank can go on
        _controller_run(rank, world, engine, channel, out_dir / "leader", fail_push_at=2)
        # then a follower fails (its process exits): rank 0 must not wait for it
        _controller_run(rank, world, engine, channel, out_dir / "follower", fail_follower_at=2)


def _run(tmp_path, name, world, mode=None, worker=_worker, timeout_s=240):
    """``worker(rank, world, init_file, out_dir, mode)`` in ``world`` spawned processes; (out_dir, exit codes)."""
    out = tmp_path / name
    out.mkdir()
    return out, run_ranks(worker, (world, str(tmp_path / f"{name}.rdv"), out, mode), world, timeout_s)


@pytest.mark.distributed
def test_two_ranks_train_like_one(tmp_path):
    one_dir, one_codes = _run(tmp_path, "one", 1)
    two_dir, two_codes = _run(tmp_path, "two", 2)
    assert one_codes == [0] and two_codes == [0, 0]
    one, two = torch.load(one_dir / "result.pt"), torch.load(two_dir / "result.pt")
    assert json.loads((two_dir / "rank1.json").read_text()) == {"stopped_by": None}
    assert len(one["stats"]) == len(two["stats"]) == STEPS
    for step, (a, b) in enumerate(zip(one["stats"], two["stats"])):
        assert set(a) == set(b) and {names.PPO_LOSS, names.TRAIN_GRAD_NORM, names.mtp_loss_key(1)} <= set(a)
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (step, key, a[key], b[key])
    # one push per update, of the same weights (policy and MTP head)
    assert [v for v, _, _ in two["pushed"]] == [v for v, _, _ in one["pushed"]] == list(range(1, STEPS + 1))
    for (_, c1, n1), (_, c2, n2) in zip(one["pushed"], two["pushed"]):
        assert n1 == n2 and math.isclose(c1, c2, rel_tol=1e-5, abs_tol=1e-4)
    assert set(one["weights"]) == set(two["weights"]) and any(n.startswith("mtp.") for n in one["weights"])
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    # the collective checkpoint of step 1 (checkpoint_every=2) and of the last step
    assert sorted(p.name for p in (two_dir / "checkpoints").glob("step_*")) == ["step_2", "step_3"]


@pytest.mark.distributed
def test_a_failing_rank_stops_the_others_instead_of_leaving_them_waiting(tmp_path):
    out, codes = _run(tmp_path, "failures", 2, "failures")
    # rank 0 failed (a weight push): its follower returned with the error, and both went on
    error = json.loads((out / "leader" / "rank0.json").read_text())["error"]
    assert "push of version 2 failed on purpose" in error
    assert (
        "push of version 2 failed on purpose"
        in json.loads((out / "leader" / "rank1.json").read_text())["stopped_by"]
    )
    # then the follower failed in its second train step: it exited with the error, rank 0 returned one
    assert codes[1] != 0 and not (out / "follower" / "rank1.json").exists()
    assert "error" in json.loads((out / "follower" / "rank0.json").read_text())
    assert codes[0] == 0


class _Channel:
    """Records what rank 0 scatters; the other ranks "answer" ``compute_logprobs`` from their shard."""

    def __init__(self, data_ranks, data_world):
        self.data_ranks, self.data_world, self.world = data_ranks, data_world, len(data_ranks)
        self.sent = None

    def scatter(self, per_rank):
        self.sent = per_rank
        return per_rank[0]

    def gather(self, mine):
        return [[torch.tensor([float(s)]) for s in args[0]] for _, args in self.sent]


class _Echo:
    def compute_logprobs(self, samples):
        return [torch.tensor([float(s)]) for s in samples]


def test_peers_of_one_data_rank_get_the_same_share_and_logprobs_come_back_in_order():
    from areal_npu.train.ranks import LeaderEngine, shard_indices

    channel = _Channel([0, 0, 1, 1], 2)  # dp 2 x tp 2 in Megatron's rank order
    samples = list(range(8))
    got = LeaderEngine(_Echo(), channel).compute_logprobs(samples)
    assert [float(t) for t in got] == [float(s) for s in samples]
    sent = [args[0] for _, args in channel.sent]
    assert sent[0] == sent[1] != sent[2] == sent[3]
    assert sorted(sent[0] + sent[2]) == samples and sent[0] == shard_indices(8, 2)[0]


def test_min_and_max_skip_micro_batches_without_loss_tokens():
    """A CP rank's zigzag share (or a DP rank's micro-batch) with no loss tokens logs 0 for every
    masked stat: that 0 is no value. Reference: min / max over the micro-batches that have tokens."""
    from areal_npu.train.stats import merge_stats

    per_mb = [(0.0, {"w/min": 0.0, "w/max": 0.0, "w/mean": 0.0}), (3.0, {"w/min": 0.5, "w/max": 2.0, "w/mean": 1.0}),
              (1.0, {"w/min": 0.25, "w/max": 1.5, "w/mean": 0.5})]  # fmt: skip
    assert merge_stats(per_mb) == {"w/min": 0.25, "w/max": 2.0, "w/mean": (3.0 * 1.0 + 0.5) / 4.0}
    assert merge_stats(per_mb[:1]) == {"w/min": 0.0, "w/max": 0.0, "w/mean": 0.0}  # no tokens anywhere


def test_a_multi_rank_recipe_starts_torchrun_with_one_process_per_rank(monkeypatch):
    from areal_npu.config import load_config
    from areal_npu.launch.torchrun import torchrun_command
    from areal_npu.recipe import RLConfig

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "quickstart.yaml")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["train", recipe, "train.dp_size=4", "--resume"]
    command = torchrun_command(load_config(RLConfig, recipe, ["train.dp_size=4"]), argv)
    assert command[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
                           "areal_npu.cli", *argv]  # fmt: skip
    assert torchrun_command(load_config(RLConfig, recipe, []), ["train", recipe]) is None  # one rank: here
    monkeypatch.setenv("WORLD_SIZE", "4")  # a rank torchrun started runs the job itself
    assert torchrun_command(load_config(RLConfig, recipe, ["train.dp_size=4"]), argv) is None
