"""Weight transports without vLLM: the broadcast's two ends in separate processes over gloo (the code
path hccl and nccl take), the sync's restarts and bounded retries, and the controller stopping with
a checkpoint. The engine side inside real vLLM engines is in ``test_weight_sync_engine.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from areal_npu.rollout import collective
from areal_npu.rollout.client import WeightSyncError
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.transports import (
    BroadcastTransport,
    RpcTransport,
    WeightSync,
    WeightSyncFailed,
    make_transport,
)

ROOT = Path(__file__).resolve().parents[2]


def mixed_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Policy and drafter names, every dtype a checkpoint holds, odd sizes (unaligned byte counts)."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(5, generator=g).to(torch.float16)),
        ("model.rotary.inv_freq", torch.arange(3, dtype=torch.int64)),
        ("model.mask", torch.tensor([True, False, True])),
        ("lm_head.weight", torch.randn(7, 5, generator=g)),
        ("mtp.fc.weight", torch.randn(5, 10, generator=g).to(torch.bfloat16)),
        ("mtp.norm.weight", torch.randn(5, generator=g)),
    ]


def test_a_bucket_survives_the_flat_buffer_bit_for_bit():
    bucket = mixed_tensors(0)
    layout = collective.bucket_layout(bucket)
    assert all(offset % collective.ALIGN == 0 for *_, offset in layout["tensors"])
    flat = collective.flatten(bucket, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == layout["nbytes"]
    back = collective.unflatten(flat.clone(), layout)
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, want), (_, got) in zip(bucket, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got, want.view(torch.uint8)
                           if want.dtype != torch.bool else want)  # fmt: skip


# A receiver process: the engine side of collective.py (join as rank 1 + index, receive buckets by
# their layouts, cut them back into tensors), writing what it got to a file for the parent.
RECEIVER = textwrap.dedent(
    """
    import json, sys, torch
    from areal_npu.rollout import collective
    info = collective.GroupInfo(**json.loads(sys.argv[1]))
    rank, layouts, out = int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    group = collective.join_group(info, rank, "127.0.0.1")
    got = {}
    try:
        for layout in layouts:
            flat = torch.empty(layout["nbytes"], dtype=torch.uint8)
            collective.broadcast(group, flat)
            got.update({name: t.clone() for name, t in collective.unflatten(flat, layout)})
        torch.save(got, out)
    except Exception as exc:
        open(out + ".error", "w").write(type(exc).__name__ + ": " + str(exc))
    group = None  # dropped before the interpreter exits (as the worker drops a failed one)
    """
)


def _start_group(world: int, layouts: list, tmp_path: Path, timeout_s: float = 60.0):
    listen = collective.listen_socket("127.0.0.1")
    info = collective.GroupInfo("gloo", "127.0.0.1", listen.getsockname()[1], "t" * 32, world, 1, timeout_s)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RECEIVER,
                json.dumps(info.to_dict()),
                str(rank),
                json.dumps(layouts),
                str(tmp_path / f"rank{rank}.pt"),
            ],
            cwd=ROOT,
            stderr=open(tmp_path / f"rank{rank}.stderr", "w"),  # noqa: SIM115 - the child's
        )  # fmt: skip
        for rank in range(1, world)
    ]
    group = collective.join_group(info, 0, "127.0.0.1", listen)
    return group, procs


def test_gloo_broadcast_from_the_trainer_to_receiver_processes_policy_and_drafter(tmp_path):
    """Two receivers (two engines' workers) get every tensor -- policy and mtp.* drafter, three
    buckets -- equal to the trainer's, bit for bit."""
    tensors = mixed_tensors(1)
    buckets = [tensors[:3], tensors[3:6], tensors[6:]]  # the last: the drafter's
    layouts = [collective.bucket_layout(b) for b in buckets]
    group, procs = _start_group(3, layouts, tmp_path)
    for b in buckets:
        collective.broadcast(group, collective.flatten(b, torch.device("cpu")))
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"rank{r}.stderr").read_text()[-2000:] for r in (1, 2)]
    for rank in (1, 2):
        assert not (tmp_path / f"rank{rank}.pt.error").exists(), (
            tmp_path / f"rank{rank}.pt.error"
        ).read_text()
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert list(got) == [n for n, _ in tensors]
        for name, want in tensors:
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_dropping_the_trainers_group_releases_a_receiver_blocked_in_a_broadcast(tmp_path):
    """How a failed sync frees the engines still alive: a receiver waiting for a bucket fails at once
    when the trainer drops its group, not after the group's timeout (60 s here)."""
    layouts = [collective.bucket_layout(mixed_tensors(2))]
    group, procs = _start_group(2, layouts, tmp_path, timeout_s=60.0)
    time.sleep(1.0)  # the receiver is in its broadcast now
    start = time.monotonic()
    del group
    assert procs[0].wait(timeout=30) == 0, (tmp_path / "rank1.stderr").read_text()[-2000:]
    assert time.monotonic() - start < 15
    assert "Error" in (tmp_path / "rank1.pt.error").read_text()


class Member:
    """An engine as the transport sees it: up or down; ``stop`` ends its process group."""

    def __init__(self, up: bool, ended: threading.Event):
        self.up, self.ended, self.stopped = up, ended, False

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.up

    def stop(self, grace_s: float = 10.0) -> None:
        self.stopped = True
        self.ended.set()


def test_a_member_that_is_down_is_ended_so_the_sender_is_not_left_waiting(monkeypatch):
    """Seen in vLLM on gloo: an engine's server was SIGKILLed while its worker, blocked in the
    broadcast, kept the connection open, and the sender waited out the group's whole timeout. The
    transport ends the process group of a member whose bucket post failed and that no longer answers;
    the send then fails, and the sync fails naming it. A member that answers is left alone."""
    ended = threading.Event()
    engines = [Member(True, ended), Member(False, ended)]

    async def post(i, path, body=None, content=None):
        if i == 1:
            raise ConnectionError("All connection attempts failed")
        return {"loaded": 1}

    async def abort_updates(indices):
        pass

    def blocked_send(group, flat):  # a gloo send to a worker that holds the connection open
        assert ended.wait(timeout=60), "the sender was left waiting for the group's timeout"
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(collective, "broadcast", blocked_send)
    client = SimpleNamespace(engines=engines, _post_json=post, abort_updates=abort_updates)
    transport = BroadcastTransport(client, "gloo", "127.0.0.1")
    transport.group = object()
    with pytest.raises(WeightSyncError) as err:
        asyncio.run(transport._broadcast(3, "policy", mixed_tensors(0)[:2]))
    assert engines[1].stopped and not engines[0].stopped
    assert "ConnectionError" in str(err.value) or "connection attempts failed" in str(err.value)
    assert transport.group is None


class FlakyTransport:
    """Fails on the engines listed per try; records what each try was asked."""

    name = "fake"

    def __init__(self, failures: list[dict[int, str]]):
        self.failures = failures
        self.asked: list[list[int] | None] = []

    async def update(self, named, version, *, sync_draft=True, engines=None):
        self.asked.append(None if engines is None else list(engines))
        failing = self.failures.pop(0) if self.failures else {}
        if failing:
            raise WeightSyncError(version, failing, [])
        return {"version": version}

    async def close(self):
        pass


class Restarts:
    """The client's restart surface: engines in ``down`` are restarted (and come back)."""

    def __init__(self, down=()):
        self.down, self.restarted = set(down), []

    async def recover_engine(self, i):
        if i in self.down:
            self.down.discard(i)
            self.restarted.append(i)
            return True
        return False


def test_failed_engines_are_restarted_when_down_and_resynced_alone():
    transport = FlakyTransport([{1: "connection refused"}])
    client = Restarts(down={1})
    result = asyncio.run(WeightSync(transport, client, retries=2).push([("w", torch.ones(1))], 5))
    assert transport.asked == [None, [1]]  # everyone, then the failed engine only
    assert client.restarted == [1] and result["restarted"] == [1]
    assert result["tries"] == 2 and "connection refused" in result["failures"][0]


def test_the_sync_gives_up_after_its_retries_naming_every_try():
    transport = FlakyTransport([{0: "boom 1"}, {0: "boom 2"}, {0: "boom 3"}, {}])
    with pytest.raises(WeightSyncFailed) as err:
        asyncio.run(WeightSync(transport, Restarts(), retries=2).push([("w", torch.ones(1))], 5))
    assert len(transport.asked) == 3  # 1 + retries, then it stops
    message = str(err.value)
    assert "version 5" in message and "weight_sync_retries=2" in message
    assert all(f"boom {n}" in message for n in (1, 2, 3))


def test_the_controller_saves_a_checkpoint_then_stops_when_the_sync_fails(tmp_path):
    from areal_npu.controller import RLController

    saved = []
    engine = SimpleNamespace(
        version=7,
        export_buckets=lambda size: [(0, [("w", torch.ones(2))])],
        save_checkpoint=lambda path, extra, tokenizer: saved.append((path, extra)),
    )
    controller = SimpleNamespace(
        engine=engine, sync_draft=True, run_dir=tmp_path, tokenizer=None,
        weight_sync=WeightSync(FlakyTransport([{0: "down"}] * 3), Restarts(), retries=1),
        pushed=False, version=6, version_event=asyncio.Event(),
    )  # fmt: skip
    with pytest.raises(WeightSyncFailed) as err:
        asyncio.run(RLController.push_weights(controller, step=3))
    assert saved == [(tmp_path / "checkpoints", {"step": 3})]
    assert "the run stops" in str(err.value) and "step 3" in str(err.value)
    assert controller.version == 6 and not controller.pushed  # the engines do not serve 7
    controller.weight_sync = WeightSync(FlakyTransport([]), Restarts())
    asyncio.run(RLController.push_weights(controller, step=4))
    assert controller.version == 7 and controller.pushed


def test_make_transport_per_config():
    client = SimpleNamespace(engines=["http://e0", "http://e1"], generation=[0, 0], bucket_bytes=1 << 20)
    assert isinstance(make_transport(RolloutConfig(model="m", device="cpu"), client), RpcTransport)
    broadcast = make_transport(RolloutConfig(model="m", device="cpu", weight_transport="gloo"), client)
    assert isinstance(broadcast, BroadcastTransport)
    assert (broadcast.backend, broadcast.sender_addr, broadcast.device.type) == ("gloo", "127.0.0.1", "cpu")
    # engines on a network address: the trainer's address comes from the plan
    away = RolloutConfig(model="m", device="cpu", weight_transport="gloo", host="10.0.0.2")
    with pytest.raises(ValueError, match="sender_addr"):
        make_transport(away, client)
    assert make_transport(away, client, sender_addr="10.0.0.1").sender_addr == "10.0.0.1"
    with pytest.raises(ValueError, match="not wired"):
        make_transport(SimpleNamespace(resolved_transport=lambda: "cuda_ipc"), client)


def test_importing_the_transports_touches_no_device_package():
    code = (
        "import sys, areal_npu.rollout.transports, areal_npu.rollout.client, areal_npu.rollout.config;"
        "bad = [m for m in ('torch_npu', 'vllm_ascend', 'vllm') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
