"""One FSDP2 PPO step on a GPU against the float64 unpacked reference (run only where a GPU is present).

float32 on CUDA: matmuls without TF32 (PyTorch's default) agree with float64 to ~1e-5 relative, so
the CPU test's tolerances hold up to reduction order (atomics in the embedding backward): 1e-4.
bfloat16: the log-probs are compared with the error of the same model run unpacked in bf16 (an
independent bf16 computation); ours must be within a small multiple of it.
"""

from __future__ import annotations

import pytest
import torch

from areal_npu import names
from areal_npu.data.packing import PackingConfig
from areal_npu.model.tiny import build_tiny_model
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import PPOLoss
from areal_npu.train.optim import OptimConfig
from tests.train.test_engine import TINY, make_engine, make_samples, naive_decoupled_loss, reference_logprobs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def test_fsdp2_step_float32_on_cuda_matches_float64_reference():
    engine, reference = make_engine(cap=24)
    assert engine.device.type == "cuda"
    samples = make_samples()
    prox = engine.compute_logprobs(samples)
    reference.double()
    for s, lp in zip(samples, prox):
        ref = reference_logprobs(reference, s.input_ids).detach()
        torch.testing.assert_close(lp.double().cpu(), ref, rtol=1e-4, atol=1e-5)
        s.prox_logp = lp.cpu()
    stats = engine.forward_backward(samples, PPOLoss())
    loss = naive_decoupled_loss(reference, samples)
    loss.backward()
    assert stats[names.PPO_LOSS] == pytest.approx(float(loss), rel=1e-4, abs=1e-6)
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double().cpu()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads["lm." + name], param.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_fsdp2_bf16_step_on_cuda_within_bf16_error():
    lm, _, _ = build_tiny_model(TINY)
    cfg = TrainEngineConfig(
        dtype="bfloat16",
        packing=PackingConfig(max_tokens_per_mb=24),
        optim=OptimConfig(lr=1e-2, grad_clip=0.0),
    )
    engine = FSDPEngine(lm, None, cfg)
    samples = make_samples()
    ours = engine.compute_logprobs(samples)
    exact_model = build_tiny_model(TINY)[0].double()
    bf16_model = build_tiny_model(TINY)[0].to(device="cuda", dtype=torch.bfloat16)
    for s, lp in zip(samples, ours):
        exact = reference_logprobs(exact_model, s.input_ids).detach()
        unpacked_bf16 = reference_logprobs(bf16_model, s.input_ids.cuda()).detach().cpu()
        err_ours = (lp.double().cpu() - exact).abs().max().item()
        err_bf16 = (unpacked_bf16 - exact).abs().max().item()
        assert err_ours <= 3 * err_bf16 + 1e-2, (err_ours, err_bf16)
        s.prox_logp = lp.cpu()
    # With π_prox from this very model the ratio is 1, so the loss is Σ w·(−A) / N over masked
    # tokens with w = π_prox/π_behave: a formula in the inputs alone.
    n = sum(int(s.loss_mask.sum()) for s in samples)
    expected = (
        sum(
            float(
                (torch.exp(s.prox_logp.double() - s.behave_logp.double()) * -float(s.advantage))[
                    s.loss_mask
                ].sum()
            )
            for s in samples
        )
        / n
    )
    stats = engine.forward_backward(samples, PPOLoss())
    assert stats[names.PPO_LOSS] == pytest.approx(expected, rel=2e-2)
