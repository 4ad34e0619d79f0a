"""Async client for the rollout engines: token ids in, token ids + log-probs + versions out.

Many concurrent workflows share one :class:`RolloutClient`. Requests go to the engine with the
fewest requests in flight. When an engine fails mid-request (connection dropped, process gone,
``/health`` failing) the client restarts it -- once, however many requests noticed -- and retries
the request (up to ``max_retries``, possibly on another engine); a request that still fails comes
back with ``failed=True`` and the error, never silently dropped and never hung (every call has a
timeout). A restarted engine serves the checkpoint it was started from (version 0) until the
trainer sends weights again; ``on_restart`` lets the trainer do that.

Every request carries the run's secret (``guard.py``), taken from the ``EngineProcess`` objects the
launcher made (or given as ``secret`` with plain URLs).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_npu import names
from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES
from areal_npu.rollout import guard
from areal_npu.rollout.buckets import pack_bucket
from areal_npu.rollout.weight_stream import iter_target_buckets, streaming
from areal_npu.speculation.acceptance import SpecCounters, SpecMetricsTracker
from areal_npu.speculation.context import ContextAcceptance

logger = logging.getLogger(__name__)


@dataclass
class GenerationSample:
    output_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each sampled token (raw, before any processing)
    versions: list[int]  # weight version that produced each token
    finish_reason: str | None
    spec: dict | None = None  # vLLM's per-request speculative summary (acceptance histogram ...)


@dataclass
class GenerationResult:
    request_id: str
    input_ids: list[int]
    samples: list[GenerationSample] = field(default_factory=list)
    engine: int = -1
    attempts: int = 0
    failed: bool = False
    error: str | None = None


class EngineFailure(RuntimeError):
    pass


class WeightSyncError(RuntimeError):
    """A weight update that did not commit on every engine it was sent to. ``failed``: engine index
    -> why; the others (``committed``) serve ``version``. An engine that failed serves the version
    it had, or -- when a broadcast had loaded part of the weights -- nothing until it gets them whole."""

    def __init__(self, version: int, failed: dict[int, str], committed: list[int]):
        self.version = version
        self.failed = dict(failed)
        self.committed = list(committed)
        reasons = "; ".join(f"engine {i}: {why}" for i, why in sorted(self.failed.items()))
        super().__init__(f"weight update to version {version} failed on {len(self.failed)} engine(s): {reasons}")


class BusyClock:
    """Engine-seconds with work: summed over engines, the time each had a request in flight while
    generation was not paused (weight updates pause it). ``tick`` before every change of either."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.total = 0.0
        self.paused = False
        self._last = clock()
        self._read = 0.0

    def tick(self, in_flight: list[int], paused: bool | None = None) -> None:
        now = self.clock()
        if not self.paused:
            self.total += (now - self._last) * sum(1 for n in in_flight if n > 0)
        self._last = now
        if paused is not None:
            self.paused = paused

    def delta(self, in_flight: list[int]) -> float:
        """Busy engine-seconds since the previous ``delta``."""
        self.tick(in_flight)
        out, self._read = self.total - self._read, self.total
        return out


class RolloutClient:
    """Client over one or more engines (``EngineProcess`` objects, or plain URLs without supervision)."""

    def __init__(
        self,
        engines: Iterable[Any],
        *,
        request_timeout_s: float = 600.0,
        max_retries: int = 2,
        restart_on_failure: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        on_restart: Callable[[int], Awaitable[None]] | None = None,
        secret: str | None = None,
        http_transport=None,  # an httpx transport (tests)
    ):
        import httpx

        self.engines = list(engines)
        held = {e.secret for e in self.engines if getattr(e, "secret", None)}
        if len(held) > 1:
            raise ValueError("engines of one client belong to one run: they hold different secrets")
        self.secret = secret or (held.pop() if held else None)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.restart_on_failure = restart_on_failure
        self.bucket_bytes = bucket_bytes
        self.on_restart = on_restart
        self.in_flight = [0] * len(self.engines)
        self.restart_locks = [asyncio.Lock() for _ in self.engines]
        self.generation = [0] * len(self.engines)  # bumped on every restart
        self.tracker = SpecMetricsTracker()
        self.by_context = ContextAcceptance()  # samples' spec pooled per context bucket until step_metrics
        self.busy = BusyClock()
        self.spec_k: int | None = None  # the draft length last set (re-applied after a restart)
        self.spec_k_body: dict = {}  # ... and the body that set it (with the per-bucket table)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            headers=guard.auth_headers(self.secret),
            transport=http_transport,
        )

    @classmethod
    def from_config(cls, cfg, engines, **kwargs) -> RolloutClient:
        return cls(
            engines,
            request_timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries,
            restart_on_failure=cfg.restart_on_failure,
            bucket_bytes=cfg.weight_bucket_bytes,
            **kwargs,
        )

    def url(self, i: int) -> str:
        engine = self.engines[i]
        return engine if isinstance(engine, str) else engine.url

    def openai_base_url(self, i: int = 0) -> str:
        """For agent frameworks: vLLM's own OpenAI-compatible routes on the same engine."""
        return self.url(i) + "/v1"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- generation ----

    async def generate(
        self,
        input_ids: list[int],
        *,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: Iterable[int] = (),
        n: int = 1,
        seed: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
    ) -> GenerationResult:
        import uuid

        request_id = request_id or uuid.uuid4().hex
        body = {
            "input_ids": [int(t) for t in input_ids],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "stop_token_ids": list(stop_token_ids),
            "n": n,
            "seed": seed,
            "ignore_eos": ignore_eos,
        }
        result = GenerationResult(request_id=request_id, input_ids=list(body["input_ids"]))
        errors: list[str] = []
        failed_on: set[int] = set()
        for attempt in range(self.max_retries + 1):
            i = self._pick(failed_on)
            generation = self.generation[i]
            result.attempts = attempt + 1
            body["request_id"] = f"{request_id}-{attempt}"
            self.busy.tick(self.in_flight)
            self.in_flight[i] += 1
            try:
                data = await self._post_json(i, "/areal/generate", body)
            except EngineFailure as exc:
                errors.append(f"engine {i}: {exc}")
                failed_on.add(i)
                if "HTTP 400" in str(exc):
                    break  # a bad request stays bad on any engine
                await self._recover(i, generation)
                continue
            finally:
                self.busy.tick(self.in_flight)
                self.in_flight[i] -= 1
            result.engine = i
            result.samples = [
                GenerationSample(
                    output_ids=s["output_ids"],
                    logprobs=s["logprobs"],
                    versions=s["versions"],
                    finish_reason=s["finish_reason"],
                    spec=s.get("spec"),
                )
                for s in data["samples"]
            ]
            for s in result.samples:
                self.by_context.add(s.spec, len(result.input_ids), len(s.output_ids))
            if any(s.finish_reason == "abort" for s in result.samples):
                errors.append(f"engine {i}: request aborted")
                failed_on.add(i)
                await self._recover(i, generation)
                continue
            return result
        result.failed = True
        result.error = "; ".join(errors)
        return result

    def _pick(self, avoid: set[int]) -> int:
        """Fewest requests in flight, round-robin among ties; engines this request failed on last."""
        n = len(self.engines)
        self._rr = (getattr(self, "_rr", -1) + 1) % n
        order = [(self._rr + j) % n for j in range(n)]
        candidates = [j for j in order if j not in avoid] or order
        return min(candidates, key=lambda j: self.in_flight[j])

    async def _post_json(self, i: int, path: str, body: Any = None, content: bytes | None = None) -> Any:
        url = self.url(i) + path
        if content is not None:
            return await self._checked(path, self._http.post(url, content=content))
        return await self._checked(path, self._http.post(url, json=body if body is not None else {}))

    async def _get_json(self, i: int, path: str) -> Any:
        return await self._checked(path, self._http.get(self.url(i) + path, timeout=30.0))

    @staticmethod
    async def _checked(path: str, request) -> Any:
        """Await an httpx request; transport errors and non-200 answers become ``EngineFailure``."""
        import httpx

        try:
            response = await request
        except httpx.HTTPError as exc:
            raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise EngineFailure(f"HTTP {response.status_code} {path}: {response.text[:500]}")
        return response.json()

    async def _recover(self, i: int, seen_generation: int, resync: bool = True) -> bool:
        """Restart engine ``i`` if it is really down; concurrent callers share one restart. With
        ``resync``, ``on_restart`` brings it to the trainer's weights (a weight sync that restarts an
        engine sends them itself). Returns whether this call restarted it."""
        engine = self.engines[i]
        if isinstance(engine, str) or not self.restart_on_failure:
            await asyncio.sleep(0.5)
            return False
        async with self.restart_locks[i]:
            if self.generation[i] != seen_generation:
                return False  # someone else restarted it meanwhile
            if await asyncio.to_thread(engine.healthy):
                return False
            await asyncio.to_thread(engine.restart)
            self.generation[i] += 1
            if self.spec_k is not None:
                try:
                    await self._post_json(i, "/areal/spec_k", self.spec_k_body)
                except EngineFailure as exc:
                    logger.warning("re-applying spec_k=%d on engine %d failed: %s", self.spec_k, i, exc)
            if resync and self.on_restart is not None:
                # inside the lock: retries wait until the trainer has re-sent its weights
                try:
                    await self.on_restart(i)
                except Exception as exc:  # noqa: BLE001 - a failed resync must not lose requests
                    logger.warning("on_restart(%d) failed: %s: %s", i, type(exc).__name__, exc)
            return True

    async def recover_engine(self, i: int) -> bool:
        """Restart engine ``i`` when it is down (dead, or ``/health`` failing), without ``on_restart``:
        for a weight sync, which re-sends the weights itself. Returns whether it was restarted."""
        return await self._recover(i, self.generation[i], resync=False)

    # ---- control ----

    async def _all(self, fn) -> list:
        return list(await asyncio.gather(*(fn(i) for i in range(len(self.engines)))))

    async def pause(self) -> None:
        self.busy.tick(self.in_flight, paused=True)
        await self._all(lambda i: self._post_json(i, "/areal/pause", {"mode": "keep"}))

    async def resume(self) -> None:
        await self._all(lambda i: self._post_json(i, "/areal/resume"))
        self.busy.tick(self.in_flight, paused=False)

    async def set_spec_k(self, k: int, by_context: list[int] | None = None) -> None:
        """Draft length of every engine from its next scheduler step on (engines with ``spec.adaptive``);
        ``by_context``: one per context bucket (``speculation/context.py``), ``k`` where nothing runs."""
        body = {"k": int(k)} | ({"by_context": [int(v) for v in by_context]} if by_context else {})
        await self._all(lambda i: self._post_json(i, "/areal/spec_k", body))
        self.spec_k, self.spec_k_body = int(k), body

    async def versions(self) -> list[int]:
        return [d["version"] for d in await self._all(lambda i: self._get_json(i, "/areal/version"))]

    async def counters(self) -> SpecCounters:
        """Cumulative acceptance counters summed over the engines that answer. An engine that is down
        (restarting after a failure) is left out rather than failing the trainer's step: its
        counters start again from 0 anyway, which the tracker's deltas treat as a restart."""
        total = SpecCounters(time=time.time())
        answers = await asyncio.gather(
            *(self._get_json(i, "/areal/metrics") for i in range(len(self.engines))), return_exceptions=True
        )
        for i, d in enumerate(answers):
            if isinstance(d, EngineFailure):
                logger.warning("engine %d left out of this step's counters: %s", i, d)
                continue
            if isinstance(d, BaseException):
                raise d
            total = total + SpecCounters.from_dict(d)
        total.time = time.time()
        return total

    async def step_metrics(self) -> dict[str, float]:
        """``rollout/spec_*`` (``rollout/spec_ctx_*``: per context bucket, from the samples' ``spec``),
        ``rollout/tokens_per_s`` (wall clock) and ``rollout/tokens_per_busy_s`` (per second an engine
        had work: the throughput speculation changes) since the previous call."""
        stats = self.tracker.step(await self.counters())
        stats.update(self.by_context.step())  # rollout/spec_ctx_*: engines with per-request statistics
        busy = self.busy.delta(self.in_flight)
        stats[names.BUSY_S] = busy
        stats[names.TOKENS_PER_BUSY_S] = stats[names.GENERATED_TOKENS] / busy if busy > 0 else 0.0
        return stats

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        sync_draft: bool = True,
        bucket_bytes: int | None = None,
        engines: Iterable[int] | None = None,
    ) -> dict:
        """One versioned update of ``engines`` (default: all) by RPC buckets: policy tensors and the
        ``mtp.*`` drafter's, each bucket drawn from ``named_tensors`` (a stream: one iteration, one
        bucket at a time, :mod:`.weight_stream`), packed once and staged on each engine while it
        keeps generating; the commit (with the tensor counts sent) applies them all at once, so
        tokens carry ``version`` exactly from the weights that were sent whole. ``sync_draft=False``
        leaves the drafter as it is (a frozen MTP head; also how the tests show what a stale drafter
        costs).

        Engines fail independently: one that fails (connection lost, an error answer) is dropped from
        the rest of the session and its session abandoned (nothing of it applied), while the others
        commit. Raises :class:`WeightSyncError` naming the failed engines after the others committed.
        """
        expect: dict[str, int] = {}
        max_bytes = bucket_bytes or self.bucket_bytes
        order = list(range(len(self.engines))) if engines is None else sorted(set(engines))
        live, failed = list(order), {}
        start = time.perf_counter()

        async def on_live(path: str, body: Any = None, content: bytes | None = None) -> dict[int, Any]:
            async def one(i):
                return await self._post_json(i, path, body, content=content)

            answers = await asyncio.gather(*(one(i) for i in live), return_exceptions=True)
            out = {}
            for i, answer in zip(list(live), answers, strict=True):
                if isinstance(answer, BaseException):
                    if not isinstance(answer, Exception):
                        raise answer
                    failed[i] = f"{path}: {answer}"
                    live.remove(i)
                else:
                    out[i] = answer
            return out

        await on_live("/areal/update_weights/begin")
        buckets = 0
        with streaming(named_tensors) as pairs:
            for target, bucket in iter_target_buckets(pairs, max_bytes, sync_draft):
                if not live:
                    break
                expect[target] = expect.get(target, 0) + len(bucket)
                payload = pack_bucket(bucket)
                await on_live(f"/areal/update_weights/bucket?target={target}", content=payload)
                buckets += 1
                del bucket, payload  # not alive while the next bucket is drawn and packed
                # each request's body (this packed bucket) sits in a reference cycle of httpx's
                # (a response and its stream): freed now, not buckets later at the next collection
                gc.collect(1)
        self.busy.tick(self.in_flight, paused=True)  # the commit pauses generation while it loads
        try:
            results = await on_live("/areal/update_weights/commit", {"version": version, "expect": expect})
        finally:
            self.busy.tick(self.in_flight, paused=False)
        await self.abort_updates(failed)
        if failed:
            raise WeightSyncError(version, failed, sorted(results))
        return {
            "version": version,
            "buckets": buckets,
            "seconds": time.perf_counter() - start,
            "loaded": [results[i]["loaded"] for i in order],
            "engines": order,
        }

    async def abort_updates(self, engines: Iterable[int]) -> None:
        """Abandon the open update session of ``engines`` (best effort: an engine that is down has none)."""

        async def one(i):
            try:
                await self._post_json(i, "/areal/update_weights/abort")
            except EngineFailure as exc:
                logger.info("abandoning the update on engine %d: %s", i, exc)

        await asyncio.gather(*(one(i) for i in engines))
