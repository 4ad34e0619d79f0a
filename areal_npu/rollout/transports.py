"""How new weights reach the engines: one interface, a transport per device family, and the sync
that retries.

A transport's ``update(named_tensors, version, sync_draft=, engines=)`` sends one versioned update of
the policy and (unless the MTP head is frozen) the drafter's ``mtp.*`` tensors, and returns once it
committed on every engine asked, or raises ``WeightSyncError`` naming the engines it did not commit
on (the others serve ``version``). It iterates ``named_tensors`` once, bucket by bucket, and sends
each bucket before it draws the next: given the trainer's export (a
:class:`.weight_stream.WeightStream`), no whole copy of the weights exists anywhere on the way.

* ``rpc`` (CPU, and the fallback anywhere): size-bounded safetensors buckets over HTTP, staged by
  each engine while it keeps generating and applied at the commit (``RolloutClient.update_weights``).
* ``hccl`` (Ascend), ``nccl`` (CUDA), ``gloo`` (CPU): :class:`BroadcastTransport`, a broadcast from
  the trainer to every engine worker in a process group of its own (``collective.py``), bucket by
  bucket into the model, policy and drafter alike. The three differ only in the backend name, so
  the CPU tests over gloo run the NPU and CUDA code path. Engines restarted since the group was
  built are re-synced by RPC buckets (a subset of the engines is not the group); a full update
  rebuilds the group first.
* ``cuda_ipc`` / ``npu_ipc`` (vLLM's own weight-transfer engines) are refused at config time:
  nothing drives them (``RolloutConfig.validate``).

:class:`WeightSync` is what the trainer calls each step: the transport, then for the engines that
failed a restart when they are down and another try (RPC or broadcast, as above), up to
``rollout.weight_sync_retries`` more times; then :class:`WeightSyncFailed`, which stops the run (the
controller saves a checkpoint first). Device packages are imported lazily, only when a broadcast
group is built.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from areal_npu.rollout import collective
from areal_npu.rollout.client import EngineFailure, WeightSyncError
from areal_npu.rollout.weight_stream import iter_target_buckets, streaming

#: transports the training loop drives
WIRED = ("rpc", *collective.TRANSPORT_BACKEND)


class WeightSyncFailed(RuntimeError):
    """A step's weights did not reach every engine within the retries: the run stops."""

    def __init__(self, version: int, attempts: list[str], retries: int, saved: str | None = None):
        self.version, self.attempts, self.retries = version, list(attempts), retries
        tries = "; ".join(f"try {n + 1}: {why}" for n, why in enumerate(attempts))
        stop = f" -- the run stops; the trainer's {saved} (--resume continues from it)" if saved else ""
        super().__init__(
            f"weight sync of version {version} failed {len(attempts)} times "
            f"(rollout.weight_sync_retries={retries}): {tries}{stop}"
        )


class WeightTransport(Protocol):
    name: str

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        sync_draft: bool = True,
        engines: Iterable[int] | None = None,
    ) -> dict: ...

    async def close(self) -> None: ...


class RpcTransport:
    """Buckets over HTTP, staged by each engine and applied at its commit."""

    name = "rpc"

    def __init__(self, client):
        self.client = client

    async def update(self, named_tensors, version, *, sync_draft=True, engines=None) -> dict:
        result = await self.client.update_weights(named_tensors, version, sync_draft=sync_draft, engines=engines)
        return result | {"transport": self.name}

    async def close(self) -> None:
        pass


class BroadcastTransport:
    """The trainer's end of the collective broadcast (``backend``: hccl, nccl or gloo).

    ``sender_addr``: where the engines reach the trainer (the plan's ``weight_transport.sender_addr``;
    127.0.0.1 on one node); the group's store listens there only. ``engine_tp``: workers per engine
    (each is a member). ``device``: where the trainer stages a bucket for the broadcast (the
    accelerator for hccl / nccl; the CPU for gloo).
    """

    def __init__(
        self,
        client,
        backend: str,
        sender_addr: str,
        *,
        engine_tp: int = 1,
        timeout_s: float = 120.0,
        device: torch.device | None = None,
    ):
        if backend not in collective.BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(collective.BACKENDS)}; got {backend!r}")
        self.name = backend
        self.client = client
        self.backend = backend
        self.sender_addr = sender_addr
        self.engine_tp = engine_tp
        self.timeout_s = timeout_s
        self.device = device or self._default_device(backend)
        self.fallback = RpcTransport(client)
        self.group = None
        self.generations: list[int] | None = None  # the engines' restart counts the group was built with
        self.groups_built = 0

    @staticmethod
    def _default_device(backend: str) -> torch.device:
        if backend == "gloo":
            return torch.device("cpu")
        from areal_npu.platform import current_platform

        return current_platform().current_device()

    async def close(self) -> None:
        self.group = None

    async def update(self, named_tensors, version, *, sync_draft=True, engines=None) -> dict:
        everyone = list(range(len(self.client.engines)))
        order = everyone if engines is None else sorted(set(engines))
        if order != everyone:  # engines restarted mid-step: not the group; RPC is the fallback
            result = await self.fallback.update(named_tensors, version, sync_draft=sync_draft, engines=order)
            return result | {"transport": f"{self.name} (rpc fallback for engines {order})"}
        start = time.perf_counter()
        await self._ensure_group(version)
        expect: dict[str, int] = {}
        buckets = 0
        with streaming(named_tensors) as pairs:  # drawn only once the group stands: a failure drains it
            await self._on_all(version, "/areal/update_weights/begin", {})
            for target, bucket in iter_target_buckets(pairs, self.client.bucket_bytes, sync_draft):
                expect[target] = expect.get(target, 0) + len(bucket)
                await self._broadcast(version, target, bucket)
                buckets += 1
                del bucket  # not alive while the next one is drawn
        answers = await self._gather("/areal/update_weights/commit", {"version": version, "expect": expect})
        failed = {i: f"commit: {a}" for i, a in answers.items() if isinstance(a, BaseException)}
        if failed:
            raise WeightSyncError(version, failed, [i for i in everyone if i not in failed])
        return {
            "version": version,
            "buckets": buckets,
            "seconds": time.perf_counter() - start,
            "loaded": [answers[i]["loaded"] for i in everyone],
            "engines": everyone,
            "transport": self.name,
        }

    async def _gather(self, path: str, body: dict) -> dict[int, Any]:
        n = len(self.client.engines)
        answers = await asyncio.gather(
            *(self.client._post_json(i, path, body) for i in range(n)), return_exceptions=True
        )
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, Exception):
                raise a
        return dict(enumerate(answers))

    async def _on_all(self, version: int, path: str, body: dict) -> None:
        """``path`` on every engine; any failure fails the whole broadcast (every engine is a member)."""
        answers = await self._gather(path, body)
        failed = {i: f"{path}: {a}" for i, a in answers.items() if isinstance(a, BaseException)}
        if failed:
            await self._fail(version, failed)

    async def _end_members_that_are_down(self, engines: list[int]) -> None:
        """End the process group of each of ``engines`` that no longer answers. An engine whose
        server died can leave its worker alive and blocked in the broadcast, holding the group's
        connection open: the sender then waits out the whole collective timeout (seen on gloo: a
        SIGKILLed server, 120 s). Its processes gone, the connection closes and the send fails at
        once; the sync restarts the engine anyway."""
        for i in engines:
            engine = self.client.engines[i]
            if hasattr(engine, "stop") and not await asyncio.to_thread(engine.healthy):
                await asyncio.to_thread(engine.stop, 1.0)

    async def _fail(self, version: int, failed: dict[int, str]):
        """Drop the group (members blocked in it fail at once), abandon every engine's session, and
        raise: a broadcast is all or nothing, so every engine is retried."""
        self.group = None
        await self.client.abort_updates(range(len(self.client.engines)))
        culprits = ", ".join(str(i) for i in sorted(failed))
        reasons = {i: failed.get(i, f"the broadcast was abandoned (engine {culprits} failed)")
                   for i in range(len(self.client.engines))}  # fmt: skip
        raise WeightSyncError(version, reasons, [])

    async def _ensure_group(self, version: int) -> None:
        if self.group is not None and self.generations == list(self.client.generation):
            return
        self.group = None  # engines restarted since: a new group, every engine joins it
        n = len(self.client.engines)
        listen = collective.listen_socket(self.sender_addr)
        port = listen.getsockname()[1]
        prefix = secrets.token_hex(16)  # the store has no authentication: its keys are unguessable
        world = 1 + n * self.engine_tp

        def info(offset: int) -> collective.GroupInfo:
            return collective.GroupInfo(self.backend, self.sender_addr, port, prefix, world, offset, self.timeout_s)

        generations = list(self.client.generation)
        joins = asyncio.ensure_future(
            asyncio.gather(
                *(
                    self.client._post_json(
                        i, "/areal/update_weights/collective/init", {"group": info(1 + i * self.engine_tp).to_dict()}
                    )
                    for i in range(n)
                ),
                return_exceptions=True,
            )
        )
        try:
            group = await asyncio.to_thread(collective.join_group, info(1), 0, self.sender_addr, listen)
        except Exception as exc:  # noqa: BLE001 - reported with the engines' answers
            group, error = None, exc
        answers = await joins
        failed = {i: f"joining the broadcast group: {a}" for i, a in enumerate(answers) if isinstance(a, BaseException)}
        if group is None and not failed:
            failed = {i: f"the trainer could not build the group: {error}" for i in range(n)}
        if failed:
            await self._fail(version, failed)
        self.group, self.generations = group, generations
        self.groups_built += 1

    async def _broadcast(self, version: int, target: str, bucket: list[tuple[str, torch.Tensor]]) -> None:
        layout = collective.bucket_layout(bucket)
        flat = collective.flatten(bucket, self.device)
        sending = asyncio.ensure_future(asyncio.to_thread(collective.broadcast, self.group, flat))
        answers = await self._gather("/areal/update_weights/collective/bucket", {"target": target, "layout": layout})
        if not sending.done():
            await self._end_members_that_are_down([i for i, a in answers.items() if isinstance(a, BaseException)])
        try:
            await sending
            error = None
        except Exception as exc:  # noqa: BLE001 - a member died or timed out
            error = exc
            self.group = None  # releases the members still blocked in this broadcast
        failed = {i: f"bucket: {a}" for i, a in answers.items() if isinstance(a, BaseException)}
        if error is not None and not failed:
            failed = {i: f"broadcast: {error}" for i in answers}
        if failed:
            await self._fail(version, failed)


class WeightSync:
    """A step's weight sync through ``transport``, with restarts and bounded retries.

    Updates are serialized: a push and the re-sync of an engine restarted outside it never interleave
    on one engine (two open sessions would mix their buckets). An engine restarted *during* a push
    (the client's generation counter moved after the try that reached it) serves its start
    checkpoint again, so the push sends it the new version once more before it returns; a re-sync
    asked for meanwhile is left to the push -- waiting for it would deadlock, since the client
    re-syncs while holding that engine's restart lock and the push may need the same lock."""

    def __init__(self, transport: WeightTransport, client, retries: int = 2):
        self.transport = transport
        self.client = client
        self.retries = retries
        self.current: tuple[Iterable, int, bool] | None = None  # the last weights every engine committed
        self._lock = asyncio.Lock()
        self._pushes = 0  # pushes waiting for or holding the lock

    @property
    def pushing(self) -> bool:
        """A push waits for the sync or runs: re-syncs asked for now are left to it."""
        return self._pushes > 0

    def _generations(self) -> list[int] | None:
        generation = getattr(self.client, "generation", None)
        return None if generation is None else list(generation)

    async def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, sync_draft: bool = True
    ) -> dict:
        """``named_tensors`` (re-iterable: every try iterates it again; a ``WeightStream`` exports the
        trainer's weights again, a list is sent again) as ``version`` to every engine. After
        a failed try, the failed engines that are down are restarted (the client's restart, without
        its own re-sync), and the failed engines -- restarted or not -- get the whole update again,
        as do engines restarted after they committed. Raises :class:`WeightSyncFailed` after
        ``1 + retries`` tries."""
        self._pushes += 1
        try:
            async with self._lock:
                result = await self._push(named_tensors, version, sync_draft)
                self.current = (named_tensors, version, sync_draft)
                return result
        finally:
            self._pushes -= 1

    async def _push(self, named_tensors, version: int, sync_draft: bool) -> dict:
        pending: list[int] | None = None
        failures: list[str] = []
        restarted: list[int] = []
        synced_at: dict[int, int] = {}  # engine -> its restart count when it committed ``version``
        for _ in range(self.retries + 1):
            before = self._generations()
            try:
                result = await self.transport.update(
                    named_tensors, version, sync_draft=sync_draft, engines=pending
                )
            except WeightSyncError as exc:
                failures.append(str(exc))
                if before is not None:
                    synced_at.update({i: before[i] for i in exc.committed})
                pending = sorted(exc.failed)
                for i in pending:
                    try:
                        if await self.client.recover_engine(i):
                            restarted.append(i)
                    except Exception as restart_error:  # noqa: BLE001 - counted as this try's failure
                        failures[-1] += f"; restarting engine {i} failed: {restart_error}"
                continue
            if before is None:
                return result | {"tries": len(failures) + 1, "failures": failures, "restarted": restarted}
            synced_at.update({i: before[i] for i in result.get("engines", range(len(before)))})
            now = self._generations()
            lost = sorted(i for i, seen in synced_at.items() if now[i] != seen)
            if not lost:
                return result | {"tries": len(failures) + 1, "failures": failures, "restarted": restarted}
            failures.append(f"engine(s) {lost} restarted during the sync: they serve their start checkpoint")
            pending = lost
        raise WeightSyncFailed(version, failures, self.retries)

    async def resync(self, engine: int, named_tensors, version: int, *, sync_draft: bool = True) -> dict:
        """Bring one engine (restarted outside a sync) to the newest weights every engine committed
        (``named_tensors`` / ``version`` unless a push since brought newer). During a push: nothing
        here, the push re-sends to engines restarted under it."""
        while self._pushes or self._lock.locked():
            if self._pushes:
                return {"version": version, "deferred": True, "engines": [engine]}
            await asyncio.sleep(0.05)  # another re-sync: no push waits, so polling cannot deadlock
        async with self._lock:
            if self.current is not None and self.current[1] > version:
                named_tensors, version, sync_draft = self.current
            return await self.transport.update(
                named_tensors, version, sync_draft=sync_draft, engines=[engine]
            )


def make_transport(cfg, client, *, sender_addr: str | None = None) -> WeightTransport:
    """The transport ``cfg.weight_transport`` resolves to (``auto``: hccl on NPU, nccl on CUDA, rpc on
    the CPU). ``sender_addr``: the plan's address of the trainer for a broadcast; on one node, where
    engines listen on loopback, 127.0.0.1."""
    transport = cfg.resolved_transport()
    if transport == "rpc":
        return RpcTransport(client)
    if transport not in collective.TRANSPORT_BACKEND:
        raise ValueError(f"weight_transport {transport!r} is not wired to the training loop (wired: {', '.join(WIRED)})")
    if sender_addr is None:
        if not _is_loopback(cfg.host):
            raise ValueError(
                f"weight_transport {transport!r} with engines on {cfg.host}: the trainer's address for the "
                "broadcast comes from the plan (weight_transport.sender_addr)"
            )
        sender_addr = "127.0.0.1"
    return BroadcastTransport(
        client,
        collective.TRANSPORT_BACKEND[transport],
        sender_addr,
        engine_tp=cfg.tensor_parallel_size,
        timeout_s=min(cfg.request_timeout_s, 120.0),
    )


def make_weight_sync(cfg, client, *, sender_addr: str | None = None) -> WeightSync:
    return WeightSync(make_transport(cfg, client, sender_addr=sender_addr), client, retries=cfg.weight_sync_retries)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = [
    "BroadcastTransport",
    "EngineFailure",
    "RpcTransport",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncFailed",
    "WeightTransport",
    "make_transport",
    "make_weight_sync",
]
