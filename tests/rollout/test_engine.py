"""End-to-end rollout engine tests: two real vLLM engines on a tiny Qwen3.5 + MTP model.

One engine speculates (MTP, k = 2, method alias ``qwen3_5_mtp``), one decodes autoregressively;
both serve the same synthetic checkpoint whose MTP head is a near-oracle drafter
(``areal_npu.testing.synthetic``: drafts mostly, not always, accepted). Every check compares with
an independent reference: a transformers forward pass of the same weights, the exact
distribution enumerated with transformers, or the other engine.

Runs on both vLLM versions (scripts/test.sh): on 0.32 the text-layout model in float32, on 0.23
(the images' version) the published layout -- a Gated DeltaNet hybrid served in bf16 -- with the
reference over the same bf16 weights and a tolerance to match (``engine_models.py``).

The tests share the two engines (module scope) and run in file order: the weight-update test
changes the speculative engine's weights and the fault test kills and restarts the plain one, so
both come last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.launch.engine_process import EngineProcess
from areal_npu.rollout import guard, vllm_features
from areal_npu.rollout.client import RolloutClient
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.config import SpecConfig
from areal_npu.testing.reference import (
    cells,
    chi2_goodness_of_fit,
    chi2_two_sample,
    exact_joint,
    greedy,
    random_prompts,
    sequence_logprobs,
)
from areal_npu.testing.synthetic import load_tensors, save_tensors
from tests.rollout.engine_models import save_engine_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 2
PROMPT = [72, 101, 108, 108, 111]  # "Hello"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return save_engine_model(tmp_path_factory.mktemp("aligned"))


@pytest.fixture(scope="module")
def model_dir(served):
    return served.path


@pytest.fixture(scope="module")
def ref(served):
    return served.load_reference()


def assert_greedy(ref, prompt, got, served, n):
    """float32 serving: the reference's argmax continuation, token for token. bf16 serving: along
    the engine's own continuation, every token is the reference's argmax up to the log-prob
    tolerance (a bf16 near-tie may go either way; a wrong model is off by far more)."""
    if served.dtype == "float32":
        assert got == greedy(ref, prompt, n)
        return
    assert len(got) == n
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt + got])).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    chosen = logp.gather(-1, torch.tensor(got)[:, None])[:, 0]
    margin = logp.max(dim=-1).values - chosen
    assert float(margin.max()) <= served.logprob_tol, margin


@pytest.fixture(scope="module")
def engines(served, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    common = dict(**served.engine_kwargs(), max_model_len=1024, startup_timeout_s=600, request_timeout_s=300)
    spec_cfg = RolloutConfig(
        **common, log_dir=str(logs / "spec"), spec=SpecConfig(method="qwen3_5_mtp", num_speculative_tokens=K)
    )
    plain_cfg = RolloutConfig(**common, log_dir=str(logs / "plain"))
    procs = [EngineProcess(spec_cfg, index=0), EngineProcess(plain_cfg, index=1)]
    for cfg in (spec_cfg, plain_cfg):
        cfg.validate()
    try:
        with ThreadPoolExecutor(2) as pool:  # start both at once: start-up is mostly imports
            for future in [pool.submit(p.start) for p in procs]:
                future.result()
        yield {"spec": procs[0], "plain": procs[1]}
    finally:
        for p in procs:
            p.stop()


async def _generate_all(engine, prompts, **kwargs):
    async with RolloutClient([engine], max_retries=0) as client:
        results = await asyncio.gather(*(client.generate(p, **kwargs) for p in prompts))
    for r in results:
        assert not r.failed, r.error
    return results


async def _generate_refused(engine, prompt, **kwargs):
    async with RolloutClient([engine], max_retries=0) as client:
        return [await client.generate(prompt, max_tokens=4, **kwargs)]


def test_behaviour_logprobs_match_transformers(engines, ref, served):
    """Every sampled token's behaviour log-prob equals log p from a transformers forward (<= 1e-4
    in float32; the bf16 tolerance on 0.23): without speculation, of the distribution sampled from
    (logits / T, then top-k and top-p, renormalised); with speculation (raw log-probs), the model's own
    at temperature 1, and a transformed distribution is refused (400, rollout/raw_sampling.py)."""
    prompts = random_prompts(4, seed=1)
    for name in ("spec", "plain"):
        for params in (
            dict(temperature=1.0),
            dict(temperature=0.7),
            dict(temperature=0.7, top_p=0.9, top_k=20),
        ):
            processed = name == "plain" and vllm_features.processed_logprobs_checked()
            if not processed and params != dict(temperature=1.0):  # raw log-probs would be wrong: refused
                (result,) = asyncio.run(_generate_refused(engines[name], prompts[0], **params))
                assert result.failed and "HTTP 400" in result.error, result.error
                # top_k under speculation is refused first for the crash it causes (generation_routes.py)
                assert "raw log-probs" in result.error or "top_k" in result.error, result.error
                continue
            sampled = params if processed else {}
            results = asyncio.run(
                _generate_all(engines[name], prompts, max_tokens=24, n=2, ignore_eos=True, **params)
            )
            for prompt, result in zip(prompts, results, strict=True):
                assert len(result.samples) == 2
                for sample in result.samples:
                    assert len(sample.output_ids) == 24 and sample.finish_reason == "length"
                    assert sample.versions == [0] * 24
                    expected = sequence_logprobs(ref, prompt, sample.output_ids, **sampled)
                    got = torch.tensor(sample.logprobs, dtype=torch.float64)
                    assert torch.allclose(got, expected, atol=served.logprob_tol, rtol=0), (
                        name,
                        params,
                        got - expected,
                    )


def test_the_trainer_scores_the_distribution_the_engine_sampled(engines, ref, served):
    """At T = 0.7 without speculation, one distribution three ways on the same tokens: the plain
    engine's behaviour log-probs, the FSDP2 trainer's log-probs at train.temperature 0.7, and the
    transformers reference (logits / 0.7): π_behave and π_θ describe what was sampled."""
    import copy

    from areal_npu.data.sample import TrainSample
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.dist import init_distributed, shutdown_distributed
    from areal_npu.train.fsdp2 import FSDPEngine

    if served.layout != "text" or not vllm_features.processed_logprobs_checked():
        pytest.skip("checked on vLLM 0.32 (the text layout, processed log-probs); 0.23 returns raw ones")
    prompts = random_prompts(3, seed=4)
    results = asyncio.run(
        _generate_all(engines["plain"], prompts, max_tokens=16, temperature=0.7, ignore_eos=True)
    )
    init_distributed()
    try:
        config = TrainEngineConfig(temperature=0.7)
        trainer = FSDPEngine(copy.deepcopy(ref), None, config, mtp_config=MTPConfig(enabled=False))
        samples = []
        for prompt, result in zip(prompts, results, strict=True):
            ids = prompt + result.samples[0].output_ids
            samples.append(TrainSample(torch.tensor(ids), torch.arange(len(ids)) >= len(prompt)))
        scored = trainer.compute_logprobs(samples)
    finally:
        shutdown_distributed()
    for prompt, result, lp in zip(prompts, results, scored, strict=True):
        sample = result.samples[0]
        expected = sequence_logprobs(ref, prompt, sample.output_ids, temperature=0.7)
        behave = torch.tensor(sample.logprobs, dtype=torch.float64)
        assert torch.allclose(behave, expected, atol=served.logprob_tol, rtol=0), behave - expected
        assert torch.allclose(lp[len(prompt) :].double(), expected, atol=served.logprob_tol, rtol=0)
        assert not torch.allclose(expected, sequence_logprobs(ref, prompt, sample.output_ids), atol=1e-2)


def test_greedy_identical_with_and_without_speculation(engines, ref, served):
    prompts = random_prompts(4, seed=2)
    outs = {
        name: asyncio.run(
            _generate_all(engines[name], prompts, max_tokens=32, temperature=0.0, ignore_eos=True)
        )
        for name in ("spec", "plain")
    }
    for i, prompt in enumerate(prompts):
        assert_greedy(ref, prompt, outs["spec"][i].samples[0].output_ids, served, 32)
        assert_greedy(ref, prompt, outs["plain"][i].samples[0].output_ids, served, 32)
    # stop ids end generation at their first occurrence (EOS ignored, as in the run it is compared with)
    stop = outs["plain"][0].samples[0].output_ids[5]
    first = outs["plain"][0].samples[0].output_ids.index(stop)
    (res,) = asyncio.run(
        _generate_all(
            engines["spec"], prompts[:1], max_tokens=32, temperature=0.0, stop_token_ids=[stop], ignore_eos=True
        )
    )
    assert res.samples[0].finish_reason == "stop"
    assert res.samples[0].output_ids[-1] == stop and len(res.samples[0].output_ids) == first + 1


def test_sampling_is_lossless_under_speculation(engines, ref):
    """At temperature 1 the joint law of the first 3 tokens is the same with and without MTP.

    Design: the model's next-token distributions concentrate on a few tokens (entropy ~0.7 nat), so
    the first 3 tokens after a fixed prompt fall into ~60 cells with an expected count >= 10 at
    N = 20 000 samples per engine (rarer outcomes pooled into one cell). Token 1 comes from the
    prefill; tokens 2 and 3 are the k = 2 draft positions, where a wrong rejection sampler would
    show. Tests at level 1e-3 each: Pearson chi-square homogeneity (spec vs plain), and
    goodness of fit of each engine to the exact law enumerated with transformers.
    Power (simulated with these N and the exact law, 300 repetitions each): against alternatives at
    total-variation distance 0.02 the two-sample test rejects 83 % (2 % of mass moved between the two
    largest cells, the hardest case) to 98 % (random directions), the goodness-of-fit tests > 99 %.
    Before the CPU sampling fix (areal_npu/compat/vllm/cpu_sampling.py) this test failed.
    """
    n_per_request, requests = 500, 40
    exact = exact_joint(ref, PROMPT, 3, min_prob=1e-6)
    total = n_per_request * requests
    keep = cells({k: v * total for k, v in exact.items()}, min_expected=10)

    async def sample(engine):
        async with RolloutClient([engine], max_retries=0) as client:
            results = await asyncio.gather(
                *(
                    client.generate(PROMPT, max_tokens=3, n=n_per_request, temperature=1.0, ignore_eos=True)
                    for _ in range(requests)
                )
            )
        assert not any(r.failed for r in results)
        return Counter(tuple(s.output_ids) for r in results for s in r.samples)

    counts_spec = asyncio.run(sample(engines["spec"]))
    counts_plain = asyncio.run(sample(engines["plain"]))
    assert sum(counts_spec.values()) == sum(counts_plain.values()) == total
    p_two, df = chi2_two_sample(counts_spec, counts_plain, keep)
    p_spec, _ = chi2_goodness_of_fit(counts_spec, exact, keep)
    p_plain, _ = chi2_goodness_of_fit(counts_plain, exact, keep)
    print(f"lossless: df={df} p(two-sample)={p_two:.3g} p(gof spec)={p_spec:.3g} p(gof plain)={p_plain:.3g}")
    assert df >= 30
    assert p_two > 1e-3 and p_spec > 1e-3 and p_plain > 1e-3, (p_two, p_spec, p_plain)


def test_acceptance_metrics_are_counter_deltas(engines):
    async def run():
        async with RolloutClient([engines["spec"]], max_retries=0) as client:
            await client.step_metrics()
            results = await asyncio.gather(
                *(client.generate(p, max_tokens=40, temperature=1.0, ignore_eos=True) for p in random_prompts(8, 3))
            )
            return results, await client.step_metrics()

    results, stats = asyncio.run(run())
    assert stats["rollout/generated_tokens"] == 8 * 40
    per_request = [r.samples[0].spec for r in results]
    if vllm_version.has("per_request_spec_metrics"):
        # the per-request summaries vLLM returns add up to the engine counters' deltas
        assert stats["rollout/spec_drafts"] == sum(m["num_spec_steps"] for m in per_request)
        assert stats["rollout/spec_accepted_tokens"] == sum(m["num_accepted_draft_tokens"] for m in per_request)
    else:  # vLLM 0.23 has no per-request summaries: the counters alone carry acceptance
        assert per_request == [None] * len(results)
    assert stats["rollout/spec_draft_tokens"] == K * stats["rollout/spec_drafts"]
    assert 0.3 < stats["rollout/spec_accept_rate"] < 0.99  # drafts accepted, and rejections exercised
    assert stats["rollout/spec_mean_accepted_len"] == pytest.approx(
        1 + stats["rollout/spec_accepted_tokens"] / stats["rollout/spec_drafts"]
    )
    assert stats["rollout/spec_accept_rate_pos0"] >= stats["rollout/spec_accept_rate_pos1"]
    assert stats["rollout/tokens_per_s"] > 0


def test_openai_endpoint_and_request_validation(engines, model_dir):
    spec = engines["spec"]
    body = {"model": str(model_dir), "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    # vLLM's OpenAI routes take the run's secret as an OpenAI client's api_key (a Bearer token)
    response = httpx.post(spec.url + "/v1/completions", json=body, timeout=60, headers=guard.auth_headers(spec.secret))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    # top_k with speculation is refused up front (it would kill vLLM 0.32), the engine stays up
    (result,) = asyncio.run(_try(spec, top_k=5))
    assert result.failed and "top_k" in result.error and result.attempts == 1
    assert spec.healthy()
    (result,) = asyncio.run(_try(engines["plain"], top_k=5))
    assert result.failed != vllm_features.processed_logprobs_checked()  # raw log-probs (0.23): refused
    # log-probs of a tempered distribution from an engine that returns raw ones: refused (raw_sampling.py)
    tempered = {**body, "temperature": 0.7, "logprobs": 0}
    headers = guard.auth_headers(spec.secret)
    response = httpx.post(spec.url + "/v1/completions", json=tempered, timeout=60, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature", response.text


async def _try(engine, **kwargs):
    async with RolloutClient([engine], max_retries=0) as client:
        return [await client.generate(PROMPT, max_tokens=4, **kwargs)]


async def _wait_for_tokens(client: RolloutClient, at_least: float, timeout: float = 60.0) -> None:
    start = (await client.counters()).generation_tokens
    deadline = time.monotonic() + timeout
    while (await client.counters()).generation_tokens - start < at_least:
        assert time.monotonic() < deadline, "no generation progress"
        await asyncio.sleep(0.2)  # polling harder starves the server's output loop and delays the counters


def test_weight_update_policy_and_drafter(engines, model_dir, served, tmp_path):
    """Online update of policy + MTP drafter: generations follow the new weights exactly; acceptance
    holds with a synced drafter and collapses with a stale one; versions are recorded per token."""
    spec = engines["spec"]
    base = load_tensors(model_dir)
    m1 = served.flip_final_norm(base, seed=1)  # new policy, drafter updated along
    m2 = served.flip_final_norm(base, seed=2, sync_draft=False)  # new policy; its mtp.* is sent to nobody
    ref1 = served.load_reference(save_tensors(tmp_path / "m1", model_dir, m1))
    ref2 = served.load_reference(save_tensors(tmp_path / "m2", model_dir, m2))
    prompts = random_prompts(4, seed=4)
    workload = random_prompts(16, seed=5)

    async def accept_rate(client):
        await client.step_metrics()
        results = await asyncio.gather(
            *(client.generate(p, max_tokens=48, temperature=1.0, ignore_eos=True) for p in workload)
        )
        return (await client.step_metrics())["rollout/spec_accept_rate"], results

    async def draft_sums(client):
        response = await client._http.post(spec.url + "/areal/debug/param_sums?target=draft")
        return {k: v for k, v in response.json().items() if "embed" not in k and "lm_head" not in k}

    async def run():
        async with RolloutClient([spec], max_retries=0, bucket_bytes=1 << 16) as client:
            accept0, _ = await accept_rate(client)
            # a long request in flight across the update: its tokens switch version 0 -> 1
            long = asyncio.create_task(
                client.generate(PROMPT, max_tokens=1000, temperature=1.0, ignore_eos=True)
            )
            await _wait_for_tokens(client, 50)
            update1 = await client.update_weights(m1.items(), version=1)
            long_result = await long
            greedy1 = await asyncio.gather(
                *(client.generate(p, max_tokens=24, temperature=0.0, ignore_eos=True) for p in prompts)
            )
            sampled1 = await asyncio.gather(
                *(client.generate(p, max_tokens=24, temperature=1.0, ignore_eos=True) for p in prompts)
            )
            accept1, _ = await accept_rate(client)
            sums_before = await draft_sums(client)
            update2 = await client.update_weights(m2.items(), version=2, sync_draft=False)
            sums_after = await draft_sums(client)
            greedy2 = await asyncio.gather(
                *(client.generate(p, max_tokens=24, temperature=0.0, ignore_eos=True) for p in prompts)
            )
            accept2, results2 = await accept_rate(client)
            return locals()

    out = asyncio.run(run())
    assert out["update1"]["buckets"] > 2  # size-bounded buckets, policy and drafter
    # every tensor sent was loaded: counted from the checkpoint (policy, then the mtp.* drafter)
    assert out["update1"]["loaded"] == [{"policy": served.policy_names, "draft": served.draft_names}]
    assert out["update2"]["loaded"] == [{"policy": served.policy_names}]

    versions = out["long_result"].samples[0].versions
    assert len(versions) == 1000 and versions == sorted(versions) and set(versions) == {0, 1}

    for prompt, g1, s1, g2 in zip(prompts, out["greedy1"], out["sampled1"], out["greedy2"], strict=True):
        assert_greedy(ref1, prompt, g1.samples[0].output_ids, served, 24)
        assert_greedy(ref2, prompt, g2.samples[0].output_ids, served, 24)
        sample = s1.samples[0]
        assert sample.versions == [1] * 24
        expected = sequence_logprobs(ref1, prompt, sample.output_ids)
        assert torch.allclose(
            torch.tensor(sample.logprobs, dtype=torch.float64), expected, atol=served.logprob_tol, rtol=0
        )
    assert all(r.samples[0].versions == [2] * 48 for r in out["results2"])

    # a frozen head (sync_draft=False) is not touched: its own weights are bit-identical
    assert out["sums_before"] == out["sums_after"]
    # acceptance: synced drafter keeps it, the stale drafter loses it
    accept0, accept1, accept2 = out["accept0"], out["accept1"], out["accept2"]
    print(f"acceptance: initial {accept0:.3f}, synced drafter {accept1:.3f}, stale drafter {accept2:.3f}")
    assert accept0 > 0.3 and accept1 > 0.7 * accept0, (accept0, accept1)
    assert accept2 < 0.5 * accept1, (accept1, accept2)


def test_engine_killed_mid_batch_recovers_without_losing_requests(engines):
    plain = engines["plain"]
    old_pgid = plain.pgid
    prompts = random_prompts(16, seed=6)
    max_tokens = 1000  # ~16K tokens: the batch is still running when the kill lands

    async def run():
        async with RolloutClient([plain], max_retries=2, request_timeout_s=300) as client:
            tasks = [
                asyncio.create_task(
                    client.generate(p, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
                )
                for p in prompts
            ]
            await _wait_for_tokens(client, 100)
            os.kill(plain.proc.pid, signal.SIGKILL)  # the engine's server process, mid-batch
            done_at_kill = sum(t.done() for t in tasks)
            return done_at_kill, await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)

    done_at_kill, results = asyncio.run(run())
    assert done_at_kill < len(prompts), "the batch finished before the kill: nothing was tested"
    assert len(results) == len(prompts)
    assert plain.restarts == 1
    with pytest.raises(ProcessLookupError):  # nothing of the killed engine survives
        os.killpg(old_pgid, 0)
    for result in results:
        if result.failed:
            assert result.error  # returned as failed, with the reason: not lost, not hung
        else:
            assert len(result.samples[0].output_ids) == max_tokens
    assert any(r.attempts > 1 and not r.failed for r in results)
    assert plain.healthy()
