"""The FSDP2 train engine against independent references: per-sequence unpacked forward passes,
a naive decoupled-PPO formula, a one-process run for two processes, an uninterrupted run for resume."""

import copy
import math

import pytest
import torch

from areal_npu import names as N
from areal_npu.algo.guard import NonFiniteError
from areal_npu.data.packing import PackingConfig
from areal_npu.data.sample import TrainSample
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import TinyModelConfig, build_tiny_model
from areal_npu.platform import current_platform
from areal_npu.testing.reference import sequence_logprobs
from areal_npu.train.checkpoint import latest_checkpoint
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed, process_group
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import PPOLoss, SFTLoss
from areal_npu.train.optim import OptimConfig
from tests.support.device import float32_grad_tolerance
from tests.support.ranks import start_processes

TINY = TinyModelConfig(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    seed=3,
    # text layout, all full attention (the former default): the FSDP2 engine's numerics are the
    # subject, the published layout has its own tests (test_engine_layout.py); GDN would be slower
    layout="text",
    linear_attention_every=0,
)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def make_samples(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p, r = 3 + i, 4 + 2 * i
        ids = torch.randint(0, 256, (p + r,), generator=g)
        mask = torch.zeros(p + r, dtype=torch.bool)
        mask[p:] = True
        mask[p + 1] = i % 2 == 0  # an environment token inside the response for some samples
        samples.append(
            TrainSample(
                input_ids=ids,
                loss_mask=mask,
                behave_logp=torch.where(
                    mask, -5.8 + 0.3 * torch.randn(p + r, generator=g), torch.zeros(p + r)
                ),
                versions=torch.where(mask, torch.full((p + r,), 0), torch.full((p + r,), -1)),
                advantage=torch.tensor(float(torch.randn((), generator=g))),
            )
        )
    return samples


def make_engine(cap=24, mtp=False, lr=1e-2, adam_eps=1e-8, temperature=1.0):
    lm, head, _ = build_tiny_model(TINY)
    reference = copy.deepcopy(lm)
    optim = OptimConfig(lr=lr, grad_clip=0.0, eps=adam_eps)
    cfg = TrainEngineConfig(
        packing=PackingConfig(max_tokens_per_mb=cap), optim=optim, temperature=temperature
    )
    mtp_cfg = MTPConfig(enabled=mtp, train=mtp)
    engine = FSDPEngine(lm, head if mtp else None, cfg, mtp_config=mtp_cfg)
    return engine, reference


def reference_logprobs(model, ids):
    logits = model(input_ids=ids[None]).logits[0].double()
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.cat([logp.new_zeros(1), logp])


def naive_decoupled_loss(model, samples, eps=0.2):
    """sum over masked tokens of w * max(-r A, -clip(r) A) / N, r = pi/pi_prox, w = pi_prox/pi_behave."""
    total, n = 0.0, sum(int(s.loss_mask.sum()) for s in samples)
    for s in samples:
        logp = reference_logprobs(model, s.input_ids)
        for t in range(len(logp)):
            if s.loss_mask[t]:
                prox, behave, adv = (
                    float(s.prox_logp[t]),
                    float(s.behave_logp[t]),
                    float(s.advantage),
                )
                r = torch.exp(logp[t] - prox)
                clipped = torch.clamp(r, 1 - eps, 1 + eps)
                total = total + math.exp(prox - behave) * torch.maximum(-r * adv, -clipped * adv)
    return total / n


def full_grads(engine):
    """The engine's gradients in float64 on the CPU, where the references live (whatever the device)."""
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double().cpu()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }


def test_logprobs_loss_and_grads_match_unpacked_reference():
    engine, reference = make_engine(cap=24)
    samples = make_samples()
    prox = engine.compute_logprobs(samples)
    for s, lp in zip(samples, prox):
        torch.testing.assert_close(
            lp.double(), reference_logprobs(reference, s.input_ids).detach(), rtol=1e-5, atol=1e-5
        )
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())
    assert stats[N.PACKING_MICRO_BATCHES] >= 3  # the cap really split the batch
    reference.double()
    loss = naive_decoupled_loss(reference, samples)
    loss.backward()
    assert stats[N.PPO_LOSS] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    grads = full_grads(engine)
    tolerance = float32_grad_tolerance(engine.device)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads["lm." + name], param.grad, **tolerance, msg=name)
    assert stats[N.BEHAVE_IMP_WEIGHT_MEAN] > 0 and stats[N.VERSION_LAG_MAX] == 0


def test_logprobs_at_a_temperature_are_the_sampled_distributions():
    """train.temperature = T: the trainer's log-prob of each token is log_softmax(z / T) of an
    unpacked transformers forward -- the reference the engines' behaviour log-probs are checked
    against (tests/rollout/test_engine.py), so π_θ and π_behave describe the same distribution."""
    engine, reference = make_engine(cap=24, temperature=0.7)
    samples = make_samples()
    for s, lp in zip(samples, engine.compute_logprobs(samples), strict=True):
        ids = s.input_ids.tolist()
        want = sequence_logprobs(reference, ids[:1], ids[1:], temperature=0.7)
        torch.testing.assert_close(lp[1:].double(), want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(want, sequence_logprobs(reference, ids[:1], ids[1:]), atol=1e-2)


def test_nonfinite_input_is_caught_and_nothing_is_applied():
    engine, _ = make_engine()
    samples = make_samples()
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    samples[2].behave_logp[-1] = float("nan")
    before = {n: t.clone() for n, t in engine.full_state_dict()}
    with pytest.raises(NonFiniteError, match="behave_logp"):
        engine.train_step(samples, PPOLoss(), step=7)
    after = dict(engine.full_state_dict())
    assert all(torch.equal(before[n], after[n]) for n in before) and engine.version == 0


def test_sft_with_mtp_trains_both_and_exports_in_buckets():
    engine, _ = make_engine(mtp=True, lr=3e-3)
    samples = [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples()]
    first = engine.train_step(samples, SFTLoss())
    for _ in range(15):
        last = engine.train_step(samples, SFTLoss())
    assert last[N.SFT_NLL] < first[N.SFT_NLL] and last[N.mtp_loss_key(1)] < first[N.mtp_loss_key(1)]
    assert 0.0 <= last[N.mtp_acc_key(1)] <= 1.0 and engine.version == 16
    names = dict(engine.full_state_dict())
    buckets = list(engine.export_buckets(bucket_bytes=40_000))
    seen = [n for _, b in buckets for n, _ in b]
    assert sorted(seen) == sorted(names)  # every tensor exactly once
    for kind, bucket in buckets:
        assert all((n.startswith("mtp.")) == (kind == "mtp") for n, _ in bucket)
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 40_000 or len(bucket) == 1


# Adam's first step is ~lr * sign(g): a large eps keeps fp-noise-sized gradients from flipping signs.
ADAM_EPS = 1e-3


def _ppo_step(engine, samples):
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())
    grads = full_grads(engine)
    engine.optimizer_step()
    return stats, grads, dict(engine.full_state_dict())


def _two_rank_worker(rank, path, samples, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        engine, _ = make_engine(cap=24, adam_eps=ADAM_EPS)
        stats, grads, weights = _ppo_step(engine, samples[rank::2])
        if rank == 0:
            torch.save({"loss": stats[N.PPO_LOSS], "grads": grads, "weights": weights}, path)


def _two_ranks_fit() -> bool:
    # each rank takes a device of its own (nccl/hccl refuse two ranks on one); gloo runs on the CPU
    plat = current_platform()
    return plat.device_type == "cpu" or plat.device_count() >= 2


@pytest.mark.distributed
@pytest.mark.skipif(not _two_ranks_fit(), reason="two ranks need two accelerators on this machine")
def test_two_gloo_ranks_equal_one_process(tmp_path):
    samples = make_samples(6)
    start_processes(
        _two_rank_worker,
        args=(str(tmp_path / "out.pt"), samples, str(tmp_path / "rdv")),
        nprocs=2,
        join=True,
    )
    engine, _ = make_engine(cap=24, adam_eps=ADAM_EPS)
    stats, grads, weights = _ppo_step(engine, samples)
    two = torch.load(tmp_path / "out.pt")
    assert two["loss"] == pytest.approx(stats[N.PPO_LOSS], rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    for name, tensor in weights.items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_resume_continues_exactly(tmp_path):
    def step(engine, seed):
        samples = make_samples(seed=seed)
        for s, lp in zip(samples, engine.compute_logprobs(samples)):
            s.prox_logp = lp
        return engine.train_step(samples, PPOLoss())

    a, _ = make_engine(mtp=True)
    step(a, 0)
    a.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 5})
    expected = step(a, 1)
    b, _ = make_engine(mtp=True)
    extra = b.load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    assert extra == {"data_position": 5} and b.version == 1
    got = step(b, 1)
    assert got[N.PPO_LOSS] == pytest.approx(expected[N.PPO_LOSS], rel=1e-6)
    wa, wb = dict(a.full_state_dict()), dict(b.full_state_dict())
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=1e-7, msg=name)
