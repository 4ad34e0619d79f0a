"""RolloutClient against stand-in engines (httpx mock transport): data-parallel routing, retries,
one restart for many failures, failures returned (never lost or hung), bucketed weight updates
(staged per engine, committed with the counts sent; an engine failing mid-update leaves the others
committing), and the run's secret on every request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from areal_npu.rollout.buckets import unpack_bucket
from areal_npu.rollout.client import RolloutClient, WeightSyncError


def sample_body(n=1, tokens=(5, 6)):
    return {
        "samples": [
            {"output_ids": list(tokens), "logprobs": [-0.5] * len(tokens), "versions": [3] * len(tokens),
             "finish_reason": "length", "spec": None}
            for _ in range(n)
        ]
    }  # fmt: skip


class Engines:
    """Stand-in engines keyed by host; ``down`` hosts refuse connections; records every request."""

    def __init__(self, hosts, delay=0.0):
        self.hosts = hosts
        self.down: set[str] = set()
        self.fail_after_buckets: dict[str, int] = {}  # host -> goes down after this many buckets
        self.headers: list[str | None] = []
        self.log: list[tuple[str, str, object]] = []
        self.delay = delay

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path + (f"?{request.url.query.decode()}" if request.url.query else "")
        self.headers.append(request.headers.get("authorization"))
        if "/bucket" in path and host in self.fail_after_buckets:
            if self.fail_after_buckets[host] == 0:
                self.down.add(host)
                raise httpx.ConnectError("connection refused", request=request)
            self.fail_after_buckets[host] -= 1
        body = request.content
        if path.endswith("/bucket?target=policy") or path.endswith("/bucket?target=draft"):
            payload = unpack_bucket(body)
        else:
            payload = json.loads(body) if body else None
        self.log.append((host, path, payload))
        if path == "/areal/generate":
            await asyncio.sleep(self.delay)
            if payload.get("top_k", -1) > 0:
                return httpx.Response(400, json={"detail": "top_k with speculative decoding"})
            return httpx.Response(200, json=sample_body(payload["n"]))
        if path == "/areal/metrics":
            return httpx.Response(
                200, json={"drafts": 10, "draft_tokens": 20, "accepted": 15, "generation_tokens": 40}
            )
        if path.endswith("/commit"):
            return httpx.Response(200, json={"version": payload["version"], "loaded": {}})
        return httpx.Response(200, json={"ok": True, "loaded": 1})


def client_for(engines, targets, **kwargs):
    return RolloutClient(targets, http_transport=httpx.MockTransport(engines.handler), **kwargs)


def test_requests_spread_over_engines_and_results_carry_everything():
    engines = Engines(["a", "b"], delay=0.05)

    async def run():
        async with client_for(engines, ["http://a", "http://b"]) as client:
            return await asyncio.gather(*(client.generate([1, 2], n=2, max_tokens=2) for _ in range(8)))

    results = asyncio.run(run())
    hosts = [h for h, path, _ in engines.log if path == "/areal/generate"]
    assert sorted(set(hosts)) == ["a", "b"] and abs(hosts.count("a") - hosts.count("b")) <= 1
    for r in results:
        assert not r.failed and len(r.samples) == 2
        assert r.samples[0].output_ids == [5, 6] and r.samples[0].versions == [3, 3]
    sent = [p for _, path, p in engines.log if path == "/areal/generate"][0]
    assert sent["input_ids"] == [1, 2] and sent["n"] == 2 and sent["max_tokens"] == 2


def test_failed_engine_is_retried_elsewhere_and_exhaustion_is_reported():
    engines = Engines(["a", "b"])
    engines.down.add("a")

    async def run(targets, retries):
        async with client_for(engines, targets, max_retries=retries) as client:
            return await client.generate([1], max_tokens=2)

    ok = asyncio.run(run(["http://a", "http://b"], 2))
    assert not ok.failed and ok.attempts == 2 and ok.engine == 1
    lost = asyncio.run(run(["http://a"], 2))
    assert lost.failed and lost.attempts == 3 and "ConnectError" in lost.error  # returned, not hung


def test_bad_request_is_not_retried():
    engines = Engines(["a"])

    async def run():
        async with client_for(engines, ["http://a"], max_retries=3) as client:
            return await client.generate([1], max_tokens=2, top_k=5)

    result = asyncio.run(run())
    assert result.failed and result.attempts == 1 and "top_k" in result.error


class FakeSupervised:
    """An EngineProcess stand-in: unhealthy until restarted."""

    def __init__(self, engines, host):
        self.engines, self.host, self.restarts = engines, host, 0

    @property
    def url(self):
        return f"http://{self.host}"

    def healthy(self):
        return self.host not in self.engines.down

    def restart(self):
        self.restarts += 1
        self.engines.down.discard(self.host)


def test_many_failures_one_restart_then_all_retried():
    engines = Engines(["a"])
    engines.down.add("a")
    supervised = FakeSupervised(engines, "a")
    restarted = []

    async def on_restart(i):
        restarted.append(i)

    async def run():
        async with RolloutClient(
            [supervised], http_transport=httpx.MockTransport(engines.handler), on_restart=on_restart
        ) as client:
            return await asyncio.gather(*(client.generate([i], max_tokens=2) for i in range(10)))

    results = asyncio.run(run())
    assert supervised.restarts == 1 and restarted == [0]
    assert all(not r.failed and r.attempts == 2 for r in results)


def test_weight_update_is_bucketed_and_sent_to_every_engine():
    engines = Engines(["a", "b"])
    tensors = [(f"model.layers.{i}.w", torch.full((256,), float(i))) for i in range(5)]  # 1 KiB each
    tensors += [("mtp.fc.weight", torch.ones(256)), ("mtp.norm.weight", torch.ones(16))]

    async def run(sync_draft):
        async with client_for(engines, ["http://a", "http://b"]) as client:
            return await client.update_weights(tensors, version=4, sync_draft=sync_draft, bucket_bytes=2048)

    result = asyncio.run(run(True))
    for host in ("a", "b"):
        calls = [(path, payload) for h, path, payload in engines.log if h == host]
        paths = [p for p, _ in calls]
        assert paths[0] == "/areal/update_weights/begin" and paths[-1] == "/areal/update_weights/commit"
        assert calls[-1][1] == {"version": 4, "expect": {"policy": 5, "draft": 2}}  # what was sent
        buckets = [(p.rsplit("=", 1)[1], payload) for p, payload in calls if "/bucket" in p]
        assert [t for t, _ in buckets] == ["policy", "policy", "policy", "draft"]
        names = [sorted(name for name, _ in b) for _, b in buckets]
        # each tensor exactly once, in order (bucket by bucket), policy before drafter
        assert names == [["model.layers.0.w", "model.layers.1.w"], ["model.layers.2.w", "model.layers.3.w"],
                         ["model.layers.4.w"], ["mtp.fc.weight", "mtp.norm.weight"]]  # fmt: skip
        assert all(sum(t.numel() * t.element_size() for _, t in b) <= 2048 for _, b in buckets)
        assert torch.equal(dict(buckets[1][1])["model.layers.2.w"], tensors[2][1])
    assert result["buckets"] == 4
    engines.log.clear()
    asyncio.run(run(False))
    assert not any("target=draft" in path for _, path, _ in engines.log)
    assert engines.log[-1][2] == {"version": 4, "expect": {"policy": 5}}


def test_an_engine_failing_mid_update_is_dropped_and_the_others_commit():
    engines = Engines(["a", "b", "c"])
    engines.fail_after_buckets["b"] = 1  # b dies at its second bucket
    tensors = [(f"model.layers.{i}.w", torch.full((256,), float(i))) for i in range(4)]

    async def run():
        async with client_for(engines, ["http://a", "http://b", "http://c"]) as client:
            with pytest.raises(WeightSyncError) as err:
                await client.update_weights(tensors, version=2, bucket_bytes=1024)
            return err.value

    error = asyncio.run(run())
    assert sorted(error.failed) == [1] and error.committed == [0, 2] and error.version == 2
    assert "bucket" in error.failed[1] and "engine 1" in str(error)
    per_host = {h: [p for host, p, _ in engines.log if host == h] for h in "abc"}
    for h in "ac":  # every bucket, then the commit
        assert per_host[h][-1] == "/areal/update_weights/commit" and sum("/bucket" in p for p in per_host[h]) == 4
    assert per_host["b"] == ["/areal/update_weights/begin", "/areal/update_weights/bucket?target=policy"]


def test_update_of_some_engines_only():
    engines = Engines(["a", "b"])

    async def run():
        async with client_for(engines, ["http://a", "http://b"]) as client:
            return await client.update_weights([("w", torch.ones(4))], version=3, engines=[1])

    result = asyncio.run(run())
    assert {h for h, _, _ in engines.log} == {"b"} and result["engines"] == [1] and len(result["loaded"]) == 1


class Holder:
    """An engine with the secret the launcher made (EngineProcess's surface the client reads)."""

    def __init__(self, host, secret):
        self.url, self.secret = f"http://{host}", secret


def test_every_request_carries_the_runs_secret():
    engines = Engines(["a", "b"])

    async def run():
        targets = [Holder("a", "s3cret"), Holder("b", "s3cret")]
        async with RolloutClient(targets, http_transport=httpx.MockTransport(engines.handler)) as client:
            await client.generate([1], max_tokens=2)
            await client.update_weights([("w", torch.ones(4))], version=1)
            await client.counters()

    asyncio.run(run())
    assert len(engines.headers) > 5 and set(engines.headers) == {"Bearer s3cret"}
    with pytest.raises(ValueError, match="different secrets"):
        RolloutClient([Holder("a", "x"), Holder("b", "y")])


def test_step_metrics_sum_engines_and_take_deltas():
    engines = Engines(["a", "b"])

    async def run():
        async with client_for(engines, ["http://a", "http://b"]) as client:
            total = await client.counters()
            first = await client.step_metrics()
            second = await client.step_metrics()
            return total, first, second

    total, first, second = asyncio.run(run())
    assert (total.drafts, total.accepted, total.generation_tokens) == (20, 30, 80)
    assert (
        first["rollout/spec_accept_rate"] == 30 / 40
        and first["rollout/spec_mean_accepted_len"] == 1 + 30 / 20
    )
    assert second["rollout/spec_drafts"] == 0  # nothing happened between the two calls


def test_busy_clock_counts_engine_seconds_with_work_outside_pauses():
    """Hand-computed: two engines, overlapping requests, a pause (weight update) in the middle."""
    from areal_npu.rollout.client import BusyClock

    now = [0.0]
    clock = BusyClock(clock=lambda: now[0])
    in_flight = [0, 0]

    def at(t, engine=None, change=0, paused=None):
        now[0] = t
        clock.tick(in_flight, paused)
        if engine is not None:
            in_flight[engine] += change

    at(0.0, 0, +1)  # engine 0 busy from 0
    at(2.0, 1, +1)  # engine 1 busy from 2
    at(3.0, paused=True)  # update: 3..5 not counted
    at(5.0, paused=False)
    at(6.0, 0, -1)  # engine 0 done at 6
    now[0] = 8.0
    # 0-2: 1 engine, 2-3: 2, 3-5: paused, 5-6: 2, 6-8: 1  ->  2 + 2 + 0 + 2 + 2
    assert clock.delta(in_flight) == pytest.approx(8.0)
    now[0] = 9.5
    assert clock.delta(in_flight) == pytest.approx(1.5)  # only engine 1, since the last read
