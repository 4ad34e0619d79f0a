"""Weight transports: the NPU (HCCL / NPU IPC) and CUDA (NCCL / IPC) paths driven with recording fakes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from areal_npu.rollout import vllm_features
from areal_npu.rollout.buckets import unpack_bucket
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.transports import (
    CollectiveTransport,
    EngineSyncClient,
    RpcTransport,
    load_trainer_engine,
    make_transport,
)

TENSORS = [
    ("model.embed_tokens.weight", torch.ones(4, 2)),
    ("lm_head.weight", torch.full((4, 2), 2.0)),
    ("mtp.fc.weight", torch.full((2, 4), 3.0)),
    ("mtp.norm.weight", torch.full((2,), 4.0)),
]


class FakeClient:
    """The RolloutClient surface the transports use; records every control-plane call."""

    def __init__(self, log, engines=2):
        self.log = log
        self.engines = [f"http://e{i}" for i in range(engines)]
        self.bucket_bytes = 1 << 20

    def url(self, i):
        return self.engines[i]

    async def _all(self, fn):
        return [await fn(i) for i in range(len(self.engines))]

    async def _post_json(self, i, path, body=None, content=None):
        if content is not None:
            body = {name: t.clone() for name, t in unpack_bucket(content)}
        self.log.append(("http", i, path, body))
        return {"loaded": 0, "version": 0}


class RecordingTrainerEngine:
    """Mimics vLLM's TrainerWeightTransferEngine: trainer_init once, send_weights per round."""

    def __init__(self, info, client, source, log):
        self.info, self.client, self.source, self.log = info, client, source, log

    @classmethod
    def trainer_init(cls, info, *, client, source):
        log = info["log"]
        client.init_weight_transfer_engine({"rendezvous": info["addr"]})
        return cls(info, client, source, log)

    def send_weights(self):
        meta = self.source.metadata()
        self.client.start_weight_update()
        self.client.update_weights({"names": [m.name for m in meta]})
        self.log.append(("collective", [name for name, _ in self.source]))
        self.client.finish_weight_update()


def make(transport, log):
    client = FakeClient(log)
    sync = EngineSyncClient(client.engines, post=lambda url, body: log.append(("sync", url, body)))
    t = CollectiveTransport(
        transport,
        client,
        {"addr": "10.0.0.1:29500", "log": log},
        engine_cls=RecordingTrainerEngine,
        sync_client=sync,
    )
    return t


def steps(log):
    out = []
    for entry in log:
        if entry[0] == "sync" and entry[1].startswith("http://e0"):
            out.append((entry[1].rsplit("/", 1)[1], entry[2]))
        elif entry[0] == "http" and entry[1] == 0:
            out.append((entry[2], entry[3]))
        elif entry[0] == "collective":
            out.append(("send", entry[1]))
    return out


@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
@pytest.mark.skipif(
    vllm_features.installed_version() is not None and not vllm_features.has("draft_weight_transfer"),
    reason="this vLLM's transfer engines load the target only (0.23): nccl/cuda_ipc are refused at config time",
)
def test_cuda_transports_send_policy_then_drafter_through_the_engine(transport):
    log = []
    t = make(transport, log)
    result = asyncio.run(t.update(TENSORS, version=7))
    got = steps(log)
    assert got[0] == ("init", {"init_info": {"rendezvous": "10.0.0.1:29500"}})
    assert got[1:] == [
        ("/areal/update_weights/begin", None),
        ("start", {"target": "policy"}),
        ("chunk", {"update_info": {"names": ["model.embed_tokens.weight", "lm_head.weight"]}}),
        ("send", ["model.embed_tokens.weight", "lm_head.weight"]),
        ("finish", {}),
        ("start", {"target": "draft"}),
        ("chunk", {"update_info": {"names": ["mtp.fc.weight", "mtp.norm.weight"]}}),
        ("send", ["mtp.fc.weight", "mtp.norm.weight"]),
        ("finish", {}),
        ("/areal/update_weights/commit", {"version": 7}),
    ]
    assert [r[:2] for r in result["rounds"]] == [("policy", transport), ("draft", transport)]
    # every engine got the same control calls
    assert sum(1 for e in log if e[0] == "http" and e[2].endswith("commit")) == 2


@pytest.mark.parametrize("transport", ["hccl", "npu_ipc"])
def test_npu_transports_send_drafter_by_rpc_buckets(transport):
    """vLLM-Ascend's engines load the target only: the drafter's mtp.* goes as rpc buckets."""
    log = []
    t = make(transport, log)
    asyncio.run(t.update(TENSORS, version=3))
    got = steps(log)
    names = [g[0] for g in got]
    assert names == [
        "init",
        "/areal/update_weights/begin",
        "start",
        "chunk",
        "send",
        "finish",
        "/areal/update_weights/bucket?target=draft",
        "/areal/update_weights/commit",
    ]
    bucket = got[names.index("/areal/update_weights/bucket?target=draft")][1]
    assert set(bucket) == {"mtp.fc.weight", "mtp.norm.weight"}
    assert torch.equal(bucket["mtp.fc.weight"], TENSORS[2][1])


def test_frozen_head_sends_no_drafter_weights():
    log = []
    t = make("nccl", log)
    asyncio.run(t.update(TENSORS, version=1, sync_draft=False))
    sent = [g for g in steps(log) if g[0] == "send"]
    assert sent == [("send", ["model.embed_tokens.weight", "lm_head.weight"])]


def test_failed_round_still_commits_and_resumes():
    log = []
    t = make("nccl", log)

    def boom():
        raise RuntimeError("broadcast failed")

    t.engine.send_weights = boom
    with pytest.raises(RuntimeError, match="broadcast failed"):
        asyncio.run(t.update(TENSORS, version=2))
    assert steps(log)[-1] == ("/areal/update_weights/commit", {"version": 2})  # generation not left paused


def test_make_transport_per_config():
    client = FakeClient([])
    assert isinstance(make_transport(RolloutConfig(model="m", device="cpu"), client), RpcTransport)
    with pytest.raises(ValueError, match="init_info"):
        make_transport(RolloutConfig(model="m", device="npu"), client)


def test_npu_engines_are_imported_lazily_and_fail_clearly():
    code = (
        "import sys, areal_npu.rollout.transports, areal_npu.rollout.client, areal_npu.rollout.config;"
        "bad = [m for m in ('torch_npu', 'vllm_ascend', 'vllm') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    pytest.importorskip("vllm")
    try:
        import vllm_ascend  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vLLM-Ascend"):
            load_trainer_engine("hccl")


def test_vllm_trainer_engine_api_matches_what_we_call():
    nccl = pytest.importorskip("vllm.distributed.weight_transfer.nccl_engine")
    if not vllm_features.has("trainer_weight_transfer"):  # 0.23: another trainer API, refused at config time
        assert not hasattr(nccl, "NCCLTrainerWeightTransferEngine")
        return
    import dataclasses

    engine_cls, info_cls = load_trainer_engine("nccl")
    assert engine_cls is nccl.NCCLTrainerWeightTransferEngine
    assert callable(engine_cls.trainer_init) and callable(engine_cls.send_weights)
    assert {"master_address", "master_port", "world_size"} <= {f.name for f in dataclasses.fields(info_cls)}
    base = pytest.importorskip("vllm.distributed.weight_transfer.base")
    for method in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert hasattr(base.VLLMWeightSyncClient, method) and hasattr(EngineSyncClient, method)
