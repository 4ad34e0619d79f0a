"""fp32 master weights under bf16 compute, and activation checkpointing, in the FSDP2 engine.

References: the float32 engine on the same batch (bf16 update within bf16 error), AdamW's first
step written out (a change below bf16's resolution survives), and the same engine without
checkpointing (gradients equal, and every layer really ran twice).
"""

from __future__ import annotations

import pytest
import torch

from areal_npu import names
from areal_npu.data.packing import PackingConfig
from areal_npu.data.sample import TrainSample
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import TinyModelConfig, build_tiny_model
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import SFTLoss
from areal_npu.train.optim import OptimConfig
from tests.train.test_engine import TINY, full_grads, make_samples

HYBRID = TinyModelConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_attention_every=2,  # Gated DeltaNet, full attention, Gated DeltaNet, full attention
    seed=5,
    layout="text",  # precision is the subject, not the layout; GDN head dim = head_dim keeps it small
    linear_head_dim=0,
)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def sft_samples(n=5, seed=0):
    return [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples(n, seed)]


def engine_for(
    dtype="float32", lr=1e-2, adam_eps=1e-8, mtp=False, checkpointing=False, tiny=TINY, cap=256, depths=1
):
    lm, head, _ = build_tiny_model(tiny)
    lm.eval()  # how from_pretrained hands a model over (checkpointing must not depend on it)
    cfg = TrainEngineConfig(
        dtype=dtype,
        gradient_checkpointing=checkpointing,
        packing=PackingConfig(max_tokens_per_mb=cap),
        optim=OptimConfig(lr=lr, grad_clip=0.0, eps=adam_eps),
    )
    mtp_cfg = MTPConfig(enabled=mtp, train=mtp, num_depths=depths)
    return FSDPEngine(lm, head if mtp else None, cfg, mtp_config=mtp_cfg)


def local_params(engine) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in engine.module.named_parameters()}


# ----------------------------------------------------------------------------- fp32 master weights


def test_bf16_engine_keeps_fp32_parameters_grads_and_optimizer_states():
    engine = engine_for("bfloat16", mtp=True)
    stats = engine.train_step(sft_samples(), SFTLoss())
    assert stats[names.PACKING_MICRO_BATCHES] == 1  # one packed micro-batch
    for name, p in engine.module.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is None or p.grad.dtype == torch.float32, name
    for state in engine.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            local = state[key].to_local() if hasattr(state[key], "to_local") else state[key]
            assert local.dtype == torch.float32
    assert all(t.dtype == torch.float32 for _, t in engine.full_state_dict())  # what checkpoints save
    exported = [t for _, bucket in engine.export_buckets() for _, t in bucket]
    assert exported and all(t.dtype == torch.bfloat16 for t in exported)  # what rollouts get


def test_bf16_update_equals_fp32_update_within_bf16_error():
    """One step from the same initial weights on the same batch. A large Adam eps makes the first
    update ``lr * g / (|g| + eps)`` nearly linear in g, so the update compares the gradients; bf16
    compute (8 mantissa bits) moves them by ~1e-2 relative: each tensor's update is within 5% of
    the fp32 update in norm (measured: at most 1.1%; with bf16 parameters, as before fp32
    masters, 3000%: the update is below bf16's resolution)."""
    samples = sft_samples()
    before = dict(engine_for("float32").full_state_dict())
    updates = {}
    for dtype in ("float32", "bfloat16"):
        engine = engine_for(dtype, lr=1e-3, adam_eps=10.0)
        engine.train_step(samples, SFTLoss())
        updates[dtype] = {n: t - before[n] for n, t in engine.full_state_dict()}
    for name, ref in updates["float32"].items():
        got = updates["bfloat16"][name]
        assert ref.norm() > 0, name
        rel = float((got - ref).norm() / ref.norm())
        assert rel <= 0.05, (name, rel)


def test_an_update_below_bf16_resolution_is_not_lost():
    """lr = 1e-6: AdamW's first step moves every weight with |g| >> eps by lr * sign(g). That is
    below half a bf16 ulp for most weights (bf16 parameters would not change at all); the fp32
    master keeps it to fp32 rounding."""
    lr = 1e-6
    engine = engine_for("bfloat16", lr=lr)
    before = {n: p.detach().clone() for n, p in local_params(engine).items()}
    engine.forward_backward(sft_samples(), SFTLoss())
    grads = {
        n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }
    engine.optimizer_step()
    after = local_params(engine)
    moved = lost_in_bf16 = checked = 0
    for name, g in grads.items():
        p0, p1 = before[name], after[name].detach()
        big = g.abs() > 1e-4  # |g| >> eps = 1e-8: the step is lr * sign(g) to 1e-4 relative
        expected = p0 - lr * torch.sign(g)
        ulp32 = torch.finfo(torch.float32).eps * p0.abs().clamp(min=torch.finfo(torch.float32).tiny)
        assert torch.all((p1 - expected).abs()[big] <= lr * 1e-3 + ulp32[big]), name
        checked += int(big.sum())
        moved += int((p1 != p0)[big].sum())
        lost_in_bf16 += int((expected.bfloat16() == p0.bfloat16())[big].sum())
    assert checked > 1000 and moved == checked
    assert lost_in_bf16 > 0.5 * checked  # the premise: in bf16 most of these updates would vanish


# ----------------------------------------------------------------------------- activation checkpointing


def _count_layer_calls(engine) -> dict[str, int]:
    calls: dict[str, int] = {}
    layers = [("lm", i, layer) for i, layer in enumerate(engine.lm.model.layers)]
    layers += [("mtp", i, layer) for i, layer in enumerate(engine.mtp.layers)]
    for kind, i, layer in layers:
        key = f"{kind}.{i}"
        calls[key] = 0
        layer.register_forward_pre_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpointing_gives_the_same_gradients_on_a_packed_micro_batch(dtype):
    """Hybrid (Gated DeltaNet + full attention) tiny model with an MTP head (2 depths), one packed
    micro-batch of 5 sequences, joint SFT + MTP loss: every gradient equals the one without
    checkpointing (float32: to 1e-6 relative; the recompute runs the same kernels on the same
    inputs), and every decoder layer of the policy and of the head really ran twice."""
    samples = sft_samples()
    grads, losses, logprobs = {}, {}, {}
    for checkpointing in (False, True):
        engine = engine_for(dtype, mtp=True, checkpointing=checkpointing, tiny=HYBRID, depths=2)
        logprobs[checkpointing] = engine.compute_logprobs(samples)  # no_grad
        calls = _count_layer_calls(engine)
        stats = engine.forward_backward(samples, SFTLoss())
        assert stats[names.PACKING_MICRO_BATCHES] == 1
        depths = engine.mtp_config.num_depths
        expected_calls = 2 if checkpointing else 1
        assert all(n == expected_calls * (depths if k.startswith("mtp") else 1) for k, n in calls.items()), (
            calls
        )
        grads[checkpointing] = full_grads(engine)
        losses[checkpointing] = (stats[names.SFT_NLL], stats[names.MTP_LOSS])
    assert losses[True] == losses[False]
    assert all(torch.equal(a, b) for a, b in zip(logprobs[True], logprobs[False], strict=True))
    assert any(n.startswith("mtp.") for n in grads[False]) and any(".linear_attn." in n for n in grads[False])
    assert grads[True].keys() == grads[False].keys()
    tol = {"rtol": 1e-6, "atol": 1e-9} if dtype == "float32" else {"rtol": 1e-2, "atol": 1e-5}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, **tol, msg=name)
