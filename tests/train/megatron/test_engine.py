"""The Megatron engine against the FSDP2 engine (the reference train engine) and against unpacked
float64 references, on the same packed micro-batches (tp = cp = 1)."""

import copy
import math

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu import names  # noqa: E402
from areal_npu.algo.guard import NonFiniteError  # noqa: E402
from areal_npu.config import ConfigError  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.data.sample import TrainSample  # noqa: E402
from areal_npu.train.dist import init_distributed  # noqa: E402
from areal_npu.train.losses import PPOLoss, SFTLoss  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import approx, tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, reference_logprobs, tiny_qwen3  # noqa: E402

CAP = 24  # forces several micro-batches for make_samples()
ADAM_EPS = 1e-3  # Adam's first step is ~lr*sign(g): a large eps keeps fp-noise gradients from flipping signs


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def megatron_engine(hf, lr=1e-2, clip=0.0, **kwargs):
    from areal_npu.train.megatron.engine import MegatronEngine

    cfg = megatron_config(
        packing=PackingConfig(max_tokens_per_mb=CAP),
        optim=OptimConfig(lr=lr, grad_clip=clip, eps=ADAM_EPS),
        **kwargs,
    )
    return MegatronEngine.from_hf_model(hf, cfg)


def fsdp_engine(hf, lr=1e-2, clip=0.0):
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine

    cfg = TrainEngineConfig(
        packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(lr=lr, grad_clip=clip, eps=ADAM_EPS)
    )
    return FSDPEngine(copy.deepcopy(hf), None, cfg)


def fsdp_grads(engine):
    return {
        n[len("lm.") :]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }


def naive_decoupled_loss(model, samples, eps=0.2):
    """Σ over loss tokens of w·max(−rA, −clip(r)A) / N in float64, unpacked, one sequence at a time."""
    total, n = 0.0, sum(int(s.loss_mask[1:].sum()) for s in samples)
    for s in samples:
        logp = reference_logprobs(model, s.input_ids)
        for t in range(1, len(logp)):
            if s.loss_mask[t]:
                prox, behave, adv = (
                    float(s.prox_logp[t]),
                    float(s.behave_logp[t]),
                    float(s.advantage),
                )
                r = torch.exp(logp[t] - prox)
                total = total + math.exp(prox - behave) * torch.maximum(
                    -r * adv, -torch.clamp(r, 0.8, 1.2) * adv
                )
    return total / n


def test_logprobs_loss_stats_and_grads_equal_the_fsdp2_engine():
    config, hf = tiny_qwen3()
    reference = copy.deepcopy(hf).double()
    mega, fsdp = megatron_engine(hf), fsdp_engine(hf)
    samples = make_samples()
    prox = mega.compute_logprobs(samples)
    for s, lp, lp_fsdp in zip(samples, prox, fsdp.compute_logprobs(samples)):
        # fp32 forward vs a float64 unpacked forward: measured <= 6e-7 on the CPU
        want = reference_logprobs(reference, s.input_ids).detach()
        torch.testing.assert_close(lp.double(), want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))
        torch.testing.assert_close(lp, lp_fsdp, **tolerance("values", dict(rtol=1e-5, atol=1e-6), lp_fsdp))
        s.prox_logp = lp
    stats = mega.forward_backward(samples, PPOLoss())
    want = fsdp.forward_backward(samples, PPOLoss())
    assert stats[names.PACKING_MICRO_BATCHES] >= 3  # the cap really split the batch
    assert set(stats) == set(want)  # same stats keys as the FSDP2 engine
    for key, value in want.items():
        assert stats[key] == pytest.approx(value, **approx("values", 1e-5, value, 1e-6)), key
    loss = naive_decoupled_loss(reference, samples)
    loss.backward()
    assert stats[names.PPO_LOSS] == pytest.approx(loss.item(), **approx("values", 1e-5, loss.item(), 1e-7))
    grads, grads_fsdp = mega.hf_grads(), fsdp_grads(fsdp)
    assert sorted(grads) == sorted(grads_fsdp)
    for name, param in reference.named_parameters():
        # CPU fp32, sums regrouped only (fused QKV / gate-up GEMMs): measured <= 1.2e-7 vs FSDP2
        tol = tolerance("grads", dict(rtol=1e-4, atol=1e-6), param.grad)
        torch.testing.assert_close(grads[name], grads_fsdp[name], **tol, msg=name)
        torch.testing.assert_close(grads[name].double(), param.grad, **tol, msg=name)


def test_optimizer_steps_with_clipping_equal_the_fsdp2_engine():
    """Two PPO steps with gradient clipping active: same norms, same weights afterwards."""
    _, hf = tiny_qwen3()
    mega, fsdp = megatron_engine(hf, clip=0.05), fsdp_engine(hf, clip=0.05)
    for seed in (0, 1):
        samples = make_samples(seed=seed)
        for s, lp in zip(samples, mega.compute_logprobs(samples)):
            s.prox_logp = lp
        got, want = mega.train_step(samples, PPOLoss()), fsdp.train_step(samples, PPOLoss())
        assert got[names.TRAIN_GRAD_NORM] > 0.05  # clipping was active
        for key in (names.TRAIN_GRAD_NORM, names.PPO_LOSS, names.TRAIN_LR, names.TRAIN_VERSION):
            assert got[key] == pytest.approx(want[key], **approx("values", 1e-5, want[key])), key
    weights = dict(mega.full_state_dict())
    for name, tensor in fsdp.full_state_dict():
        torch.testing.assert_close(
            weights[name], tensor, **tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor), msg=name
        )
    assert mega.version == 2


def test_sft_learns_and_nonfinite_input_applies_nothing():
    _, hf = tiny_qwen3()
    mega = megatron_engine(hf, lr=3e-3)
    samples = [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples()]
    first = mega.train_step(samples, SFTLoss())
    for _ in range(5):
        last = mega.train_step(samples, SFTLoss())
    assert last[names.SFT_NLL] < first[names.SFT_NLL] - 0.1 and mega.version == 6
    ppo = make_samples()
    for s, lp in zip(ppo, mega.compute_logprobs(ppo)):
        s.prox_logp = lp
    ppo[2].behave_logp[-1] = float("nan")
    before = {n: t.clone() for n, t in mega.full_state_dict()}
    with pytest.raises(NonFiniteError, match="behave_logp"):
        mega.train_step(ppo, PPOLoss(), step=7)
    after = dict(mega.full_state_dict())
    assert all(torch.equal(before[n], after[n]) for n in before) and mega.version == 6


def test_options_it_cannot_honour_are_refused():
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.train.config import MegatronLayoutConfig, TrainEngineConfig
    from areal_npu.train.megatron.engine import MegatronEngine

    config, hf = tiny_qwen3()
    with pytest.raises(ConfigError, match="packing.tp_size"):
        megatron_config(2, packing=PackingConfig(tp_size=4)).validate()
    for kwargs, key in (  # pipeline layouts: test_pipeline.py
        (dict(megatron=MegatronLayoutConfig(sequence_parallel=True)), "megatron.sequence_parallel"),
    ):
        with pytest.raises(ConfigError, match=key):
            MegatronEngine(config, hf.state_dict(), TrainEngineConfig(backend="megatron", **kwargs))
    with pytest.raises(ConfigError, match="mtp.num_depths"):  # more in test_mtp.py
        MegatronEngine(
            config, hf.state_dict(), megatron_config(), mtp_config=MTPConfig(enabled=True, num_depths=2)
        )
