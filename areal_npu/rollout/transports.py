"""How new weights reach the engines: one interface, a transport per device family.

* ``rpc`` (CPU, and anywhere as the fallback): size-bounded safetensors buckets over HTTP, loaded
  in each worker through ``collective_rpc`` + vLLM's layer-wise reload (``RolloutClient.update_weights``).
* ``nccl`` / ``cuda_ipc`` (CUDA): vLLM's weight-transfer engines
  (``vllm.distributed.weight_transfer``: ``NCCLTrainerWeightTransferEngine``,
  ``IPCTrainerWeightTransferEngine``), which also update the drafter (``start_draft_weight_update``).
* ``hccl`` / ``npu_ipc`` (Ascend): vLLM-Ascend's engines of the same protocol. vLLM-Ascend v0.23
  loads them into the target model only, so the MTP drafter's ``mtp.*`` tensors (one layer, small)
  go through the ``rpc`` buckets in the same paused session -- as on any vLLM without
  ``draft_weight_transfer`` (``vllm_features.py``; vLLM 0.23 itself).

Every transport runs one versioned session: pause (in-flight requests kept) -> policy -> drafter
(unless the head is frozen) -> commit version + resume. Device packages are imported lazily, only
when such a transport is built; the trainer-side engine class can be injected (tests use a
recording fake).
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from areal_npu.rollout.buckets import iter_buckets, pack_bucket, split_policy_and_draft

#: transport -> (module, trainer engine class, init-info class); vLLM-Ascend names per its docs.
TRAINER_ENGINES = {
    "nccl": (
        "vllm.distributed.weight_transfer.nccl_engine",
        "NCCLTrainerWeightTransferEngine",
        "NCCLTrainerInitInfo",
    ),
    "cuda_ipc": (
        "vllm.distributed.weight_transfer.ipc_engine",
        "IPCTrainerWeightTransferEngine",
        "IPCTrainerInitInfo",
    ),
    "hccl": (
        "vllm_ascend.distributed.weight_transfer.hccl_engine",
        "HCCLTrainerWeightTransferEngine",
        "HCCLTrainerInitInfo",
    ),
    "npu_ipc": (
        "vllm_ascend.distributed.weight_transfer.ipc_engine",
        "NPUIPCTrainerWeightTransferEngine",
        "NPUIPCTrainerInitInfo",
    ),
}
#: transports whose engines cannot load the drafter (vLLM-Ascend v0.23): drafter goes by rpc buckets
DRAFT_BY_RPC = ("hccl", "npu_ipc")


def draft_by_rpc(transport: str) -> bool:
    """Whether the drafter's ``mtp.*`` tensors go as rpc buckets rather than through ``transport``:
    vLLM-Ascend's engines, and any vLLM whose weight-transfer engines load the target model only
    (0.23: ``vllm_features`` ``draft_weight_transfer``). Engines run the vLLM installed here
    (without one, the trainer-side engine classes cannot be imported either: tests inject them)."""
    from areal_npu.rollout import vllm_features

    if transport in DRAFT_BY_RPC:
        return True
    return vllm_features.installed_version() is not None and not vllm_features.has("draft_weight_transfer")


def load_trainer_engine(transport: str) -> tuple[type, type]:
    """(engine class, init-info class), imported only now; a clear error when the stack lacks them."""
    module_name, engine_name, info_name = TRAINER_ENGINES[transport]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        need = "vLLM-Ascend (the NPU images)" if transport in DRAFT_BY_RPC else "vLLM with CUDA"
        raise ImportError(
            f"weight_transport {transport!r} needs {need}: cannot import {module_name} ({exc})"
        ) from exc
    return getattr(module, engine_name), getattr(module, info_name)


class SwitchableSource:
    """A re-iterable weight source whose tensors are swapped per round (policy, then drafter).

    Implements vLLM's ``WeightSource`` surface: ``metadata()`` and iteration.
    """

    def __init__(self):
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def set(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = list(tensors)

    def metadata(self):
        try:
            from vllm.distributed.weight_transfer.base import ParamMeta
        except ImportError:  # tests without vLLM
            from types import SimpleNamespace as ParamMeta
        return [ParamMeta(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.tensors]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


class EngineSyncClient:
    """vLLM's synchronous ``VLLMWeightSyncClient`` protocol against our engines' collective routes.

    ``target`` picks what ``start_weight_update`` starts: the policy or the drafter.
    """

    def __init__(self, urls: list[str], post: Callable[[str, dict], Any] | None = None, timeout: float = 600):
        self.urls = urls
        self.target = "policy"
        self._post = post or self._http_post
        self.timeout = timeout

    def _http_post(self, url: str, body: dict) -> Any:
        import httpx

        response = httpx.post(url, json=body, timeout=self.timeout)
        response.raise_for_status()
        return response.json()

    def _all(self, path: str, body: dict) -> None:
        for url in self.urls:
            self._post(url + "/areal/update_weights/collective/" + path, body)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:  # pragma: no cover - nothing to release on our side
        pass

    def start_weight_update(self) -> None:
        self._all("start", {"target": self.target})

    def update_weights(self, update_info: dict) -> None:
        self._all("chunk", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish", {})


class CollectiveTransport:
    """Device-to-device weight sync through a trainer-side weight-transfer engine (NCCL/HCCL/IPC)."""

    def __init__(
        self,
        transport: str,
        client,  # RolloutClient: pause/commit session and the rpc drafter path
        init_info: dict,
        *,
        engine_cls: type | None = None,
        init_info_cls: type | None = None,
        sync_client: EngineSyncClient | None = None,
    ):
        if transport not in TRAINER_ENGINES:
            raise ValueError(f"transport must be one of {', '.join(TRAINER_ENGINES)}; got {transport!r}")
        self.transport = transport
        self.client = client
        if engine_cls is None:
            engine_cls, init_info_cls = load_trainer_engine(transport)
        self.source = SwitchableSource()
        self.sync_client = sync_client or EngineSyncClient(
            [client.url(i) for i in range(len(client.engines))]
        )
        info = init_info_cls(**init_info) if init_info_cls is not None else init_info
        self.engine = engine_cls.trainer_init(info, client=self.sync_client, source=self.source)

    async def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, sync_draft: bool = True
    ) -> dict:
        policy, draft = split_policy_and_draft(named_tensors)
        start = time.perf_counter()
        await self.client._all(lambda i: self.client._post_json(i, "/areal/update_weights/begin"))
        rounds = []
        try:
            self.sync_client.target = "policy"
            self.source.set(policy)
            await asyncio.to_thread(self.engine.send_weights)
            rounds.append(("policy", self.transport, len(policy)))
            if sync_draft and draft:
                if draft_by_rpc(self.transport):
                    for bucket in iter_buckets(draft, self.client.bucket_bytes):
                        payload = pack_bucket(bucket)
                        await self.client._all(
                            lambda i, p=payload: self.client._post_json(
                                i, "/areal/update_weights/bucket?target=draft", content=p
                            )
                        )
                    rounds.append(("draft", "rpc", len(draft)))
                else:
                    self.sync_client.target = "draft"
                    self.source.set(draft)
                    await asyncio.to_thread(self.engine.send_weights)
                    rounds.append(("draft", self.transport, len(draft)))
        finally:
            self.sync_client.target = "policy"
            await self.client._all(
                lambda i: self.client._post_json(i, "/areal/update_weights/commit", {"version": version})
            )
        return {"version": version, "rounds": rounds, "seconds": time.perf_counter() - start}


class RpcTransport:
    """Buckets over HTTP into ``collective_rpc`` (the CPU path)."""

    def __init__(self, client):
        self.client = client

    async def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, sync_draft: bool = True
    ) -> dict:
        return await self.client.update_weights(named_tensors, version, sync_draft=sync_draft)


def make_transport(cfg, client, init_info: dict | None = None, **kwargs):
    """The transport ``cfg.weight_transport`` names (``auto``: hccl on NPU, nccl on CUDA, rpc on CPU)."""
    transport = cfg.resolved_transport()
    if transport == "rpc":
        return RpcTransport(client)
    if init_info is None:
        raise ValueError(f"weight_transport {transport!r} needs init_info (rendezvous address, world size)")
    return CollectiveTransport(transport, client, init_info, **kwargs)
