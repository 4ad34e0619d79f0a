"""Weight sync as a stream (``rollout/weight_stream.py``, ``RLController.push_weights`` /
``resync_engine``): no whole copy of the weights anywhere on the trainer's side.

* A push of a 256 MiB model in 16 MiB buckets through the real controller, ``WeightSync``,
  ``RpcTransport`` and ``RolloutClient`` to a stand-in engine, each measure in a fresh process (the
  growth of VmHWM): the trainer's side holds at most 2 buckets + 16 MiB (the bucket's tensors and
  its packed bytes); with the stand-in engine's safetensors reader in the same process, 4 buckets +
  16 MiB. Materialising the weights (what the controller kept before, ``last_named``) grows it by
  the model's size: the measure does see a whole copy. The engine receives every tensor once, equal
  to the trainer's (each weight is a formula of its index, recomputed on the engine's side).
* A restarted engine is re-synced by a fresh export while the trainer waits for its batch (two
  restarted engines in turn); while the trainer computes, pushes or saves nothing is read (the push
  that ends the step reaches it).
* An update that stops early (every engine failed) still runs the trainer's export to its end: the
  other trainer ranks are in its collectives.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from areal_npu.algo.advantages import GRPOConfig
from areal_npu.controller import ControllerConfig, RLController
from areal_npu.data.buckets import iter_kind_buckets
from areal_npu.rollout.buckets import unpack_bucket
from areal_npu.rollout.client import RolloutClient, WeightSyncError
from areal_npu.rollout.transports import RpcTransport, WeightSync
from areal_npu.rollout.weight_stream import WeightStream, streaming
from areal_npu.speculation.config import SpecConfig
from areal_npu.testing.memory import reset_peak_rss, status_bytes

MiB = 1 << 20


def weight(i: int, numel: int) -> torch.Tensor:
    """Tensor ``i`` of the model: a formula of its index, freshly allocated (as a gather yields it)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(i))


def name(i: int, count: int) -> str:
    return f"mtp.layers.{i}.w" if i >= count - 2 else f"model.layers.{i}.w"  # the last two: the drafter


class Trainer:
    """A train engine's ``export_buckets``: ``count`` tensors of ``numel`` fp32, each made when drawn."""

    def __init__(self, count: int, numel: int):
        self.count, self.numel, self.version = count, numel, 1
        self.exports = self.drawn = 0

    def export_buckets(self, bucket_bytes, kinds=("policy", "mtp")):
        self.exports += 1

        def named():
            for i in range(self.count):
                self.drawn += 1
                yield "mtp" if i >= self.count - 2 else "policy", name(i, self.count), weight(i, self.numel)

        yield from iter_kind_buckets(named(), bucket_bytes)


class Engines:
    """Stand-in engines: check each received tensor against the formula, keep only its name (or,
    without ``check``, only count the body's bytes: what the trainer's side alone holds)."""

    def __init__(self, trainer: Trainer, down: tuple[str, ...] = (), check: bool = True):
        self.trainer, self.down, self.check = trainer, set(down), check
        self.received: dict[str, list[str]] = {}
        self.body_bytes = 0
        self.commits: dict[str, dict] = {}
        self.mismatched: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host in self.down and path.endswith("/bucket"):
            raise httpx.ConnectError("connection refused", request=request)
        if path.endswith("/begin"):
            self.received[host] = []
        elif path.endswith("/bucket") and not self.check:
            self.body_bytes += len(request.content)
        elif path.endswith("/bucket"):
            for n, t in unpack_bucket(request.content):
                self.received[host].append(n)
                if not torch.equal(t, weight(int(n.split(".")[2]), self.trainer.numel)):
                    self.mismatched.append(n)
        elif path.endswith("/commit"):
            self.commits[host] = json.loads(request.content)
            return httpx.Response(200, json={"version": self.commits[host]["version"], "loaded": {}})
        return httpx.Response(200, json={"ok": True})


def controller(trainer: Trainer, client: RolloutClient, run_dir: Path) -> RLController:
    return RLController(
        ControllerConfig(), trainer, None, client, [], run_dir, None, spec=SpecConfig(), grpo=GRPOConfig(),
        loss=None, seed=0, weight_sync=WeightSync(RpcTransport(client), client),
    )  # fmt: skip


def _peak_growth(action) -> int:
    """Bytes the peak resident memory (VmHWM) grows by while ``action()`` runs, from now."""
    gc.collect()
    assert reset_peak_rss()  # the peak restarts from the current RSS
    base = status_bytes("VmRSS")
    action()
    return status_bytes("VmHWM") - base


def measure(what: str, model_bytes: int, bucket_bytes: int, run_dir: Path) -> dict:
    """In a fresh process, the peak growth while ``what`` runs on ``model_bytes`` of 1 MiB tensors:
    ``checked`` (a push in ``bucket_bytes`` buckets to the checking stand-in engine), ``counted`` (to
    the counting one: the trainer's side alone), ``whole`` (materialising the weights: the copy
    ``last_named`` was). A process's allocator keeps what it freed, so one measure per process."""
    from areal_npu.controller import exported

    trainer = Trainer(model_bytes // MiB, MiB // 4)

    def push(trainer: Trainer, engines: Engines) -> None:
        transport = httpx.MockTransport(engines.handler)

        async def run():
            client = RolloutClient(["http://e0"], http_transport=transport, bucket_bytes=bucket_bytes)
            async with client:
                await controller(trainer, client, run_dir).push_weights()

        asyncio.run(run())

    engines = Engines(trainer, check=what == "checked")
    push(Trainer(8, MiB // 4), Engines(trainer, check=what == "checked"))  # warm-up: code paths loaded
    if what == "whole":
        return {"growth": _peak_growth(lambda: list(exported(trainer)))}
    growth = _peak_growth(lambda: push(trainer, engines))
    received = engines.received.get("e0", [])
    return {"growth": growth, "received": received, "commit": engines.commits["e0"],
            "mismatched": engines.mismatched, "count": trainer.count, "body_bytes": engines.body_bytes}  # fmt: skip


def _measured(what: str, model: int, bucket: int, run_dir: Path) -> dict:
    here = str(Path(__file__).parent)
    code = f"import sys, json; sys.path.insert(0, {here!r}); import test_weight_stream as t; "
    code += f"print(json.dumps(t.measure({what!r}, {model}, {bucket}, t.Path({str(run_dir)!r}))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_push_holds_a_few_buckets_not_the_model(tmp_path):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc (VmHWM reset through clear_refs)")
    model, bucket = 256 * MiB, 16 * MiB
    checked, counted, whole = (_measured(w, model, bucket, tmp_path) for w in ("checked", "counted", "whole"))
    count = checked["count"]
    assert sorted(checked["received"]) == sorted(name(i, count) for i in range(count))
    assert not checked["mismatched"]
    assert checked["commit"] == {"version": 1, "expect": {"policy": count - 2, "draft": 2}}
    assert counted["body_bytes"] >= model and counted["commit"] == checked["commit"]  # sent it all too
    print(f"model {model / MiB:.0f} MiB, bucket {bucket / MiB:.0f} MiB: peak +{counted['growth'] / MiB:.1f} MiB "
          f"(trainer's side), +{checked['growth'] / MiB:.1f} MiB (with the checking engine), "
          f"a whole copy +{whole['growth'] / MiB:.1f} MiB")  # fmt: skip
    # the trainer's side: the bucket's tensors and its packed bytes (+ the next tensor, allocator, httpx)
    assert counted["growth"] <= 2 * bucket + 16 * MiB
    # with the stand-in engine's safetensors reader (a copy of the body and the tensors it makes)
    assert checked["growth"] <= 4 * bucket + 16 * MiB
    assert whole["growth"] >= 0.9 * model  # the measure sees a whole copy where there is one


def _client(engines: Engines, hosts: list[str], bucket_bytes: int) -> RolloutClient:
    transport = httpx.MockTransport(engines.handler)
    return RolloutClient([f"http://{h}" for h in hosts], http_transport=transport, bucket_bytes=bucket_bytes)


def test_a_restarted_engine_is_resynced_from_a_fresh_export_only_while_the_trainer_waits(tmp_path):
    trainer = Trainer(6, 64)
    engines = Engines(trainer)

    async def run():
        async with _client(engines, ["e0", "e1"], 512) as client:
            rl = controller(trainer, client, tmp_path)
            await rl.resync_engine(1)  # before any push the engines serve the trainer's start weights
            assert trainer.exports == 0 and not engines.received
            await rl.push_weights()
            assert trainer.exports == 1 and sorted(engines.received) == ["e0", "e1"]
            engines.received.clear()
            async with rl.trainer_phase():  # the trainer computes: nothing read, the step's push covers it
                await rl.resync_engine(1)
            assert trainer.exports == 1 and not engines.received
            await rl.resync_engine(1)  # the trainer waits for its batch: streamed again, to engine 1 only
            assert trainer.exports == 2 and list(engines.received) == ["e1"]
            engines.received.clear()
            await asyncio.gather(rl.resync_engine(0), rl.resync_engine(1))  # two restarts: they take turns
            return rl

    rl = asyncio.run(run())
    assert trainer.exports == 4 and sorted(engines.received) == ["e0", "e1"] and not engines.mismatched
    for host in ("e0", "e1"):
        assert sorted(engines.received[host]) == sorted(name(i, 6) for i in range(6)) and rl.version == 1
        assert engines.commits[host] == {"version": 1, "expect": {"policy": 4, "draft": 2}}


def test_an_update_that_stops_early_still_runs_the_export_to_its_end():
    trainer = Trainer(6, 64)
    engines = Engines(trainer, down=("e0", "e1"))  # every engine fails at its first bucket

    async def run():
        async with _client(engines, ["e0", "e1"], 512) as client:
            with pytest.raises(WeightSyncError):
                await RpcTransport(client).update(WeightStream(lambda: trainer_pairs(trainer)), 1)

    asyncio.run(run())
    assert trainer.drawn == 6 and trainer.exports == 1  # the export's collectives all ran
    pairs = WeightStream(lambda: trainer_pairs(trainer))
    with pytest.raises(RuntimeError, match="consumer"), streaming(pairs) as it:
        next(it)
        raise RuntimeError("the consumer failed")
    assert trainer.drawn == 12 and trainer.exports == 2


def trainer_pairs(trainer: Trainer):
    return (pair for _, bucket in trainer.export_buckets(512) for pair in bucket)
