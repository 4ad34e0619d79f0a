"""The Megatron engine's MTP head (Megatron-Core's ``MultiTokenPredictionLayer``) against the FSDP2
engine's (:class:`areal_npu.model.mtp.Qwen35MTP`, the reference): same packed micro-batches, one
rank -- MTP loss and accuracy, the head's gradients under ``mtp.*`` names, the policy's gradients
(isolation: the head's loss reaches neither backbone, embedding nor output head), the weights after
an optimizer step (own group: lr x lr_scale, clipped apart) and the export under ``mtp.*`` names.
TP=2 (with sequence parallelism) over two gloo ranks against one rank: ``test_mtp_parallel.py``."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu import names  # noqa: E402
from areal_npu.config import ConfigError  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights  # noqa: E402
from areal_npu.train.dist import init_distributed  # noqa: E402
from areal_npu.train.losses import PPOLoss  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import approx, tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, tiny_qwen3  # noqa: E402

CAP = 24
OPTIM = dict(lr=1e-2, grad_clip=0.5, eps=1e-3)
MTP = MTPConfig(enabled=True, train=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def _head(config):
    """A head whose zero-centred norms are away from 0 (a norm mapped without its ``1 +`` fails)."""
    head = Qwen35MTP(config, 1)
    g = torch.Generator().manual_seed(11)
    init_mtp_weights(head, std=0.08, generator=g)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return head


def _grads(named):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in named
        if p.grad is not None
    }


def _full(named):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named}


def _run(engine, samples, mtp_named, lm_named):
    prox = engine.compute_logprobs(samples)
    for s, lp in zip(samples, prox):
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())
    return stats, mtp_named(engine), lm_named(engine)


def test_mtp_loss_grads_step_and_export_equal_the_fsdp2_engine():
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.megatron.engine import MegatronEngine

    config, hf = tiny_qwen3()
    head = _head(config)
    original = {"mtp." + n: p.detach().clone() for n, p in head.named_parameters()}
    fsdp = FSDPEngine(
        copy.deepcopy(hf),
        copy.deepcopy(head),
        TrainEngineConfig(packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(**OPTIM)),
        mtp_config=copy.deepcopy(MTP),
    )
    meg = MegatronEngine.from_hf_model(
        hf,
        megatron_config(packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(**OPTIM)),
        mtp=head,
        mtp_config=copy.deepcopy(MTP),
    )
    exported = {n: t.clone() for n, t in meg.full_state_dict() if n.startswith("mtp.")}
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():  # zero-centred norms: (1 + w) - 1 within an ulp of 1
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=2e-7, msg=name)

    samples = make_samples(6)
    f_stats, f_mtp, f_lm = _run(
        fsdp,
        copy.deepcopy(samples),
        lambda e: _grads((f"mtp.{n}", p) for n, p in e.module.mtp.named_parameters()),
        lambda e: _grads((n[len("lm.") :], p) for n, p in e.module.named_parameters() if n.startswith("lm.")),
    )
    m_stats, m_grads, _ = _run(meg, copy.deepcopy(samples), lambda e: e.hf_grads(), lambda e: None)
    for key in (names.MTP_LOSS, names.mtp_loss_key(1), names.mtp_acc_key(1), names.PPO_LOSS):
        assert m_stats[key] == pytest.approx(f_stats[key], **approx("values", 1e-5, f_stats[key], 1e-7)), key
    assert (
        f_stats[names.MTP_LOSS] > 0 and m_stats[names.mtp_count_key(1)] == f_stats[names.mtp_count_key(1)] > 0
    )
    assert sorted(n for n in m_grads if n.startswith("mtp.")) == sorted(f_mtp)
    for name, grad in {**f_mtp, **f_lm}.items():
        assert grad.abs().sum() > 0 or not name.startswith("mtp."), name
        tol = tolerance("grads", dict(rtol=1e-4, atol=1e-7), grad)
        torch.testing.assert_close(m_grads[name], grad, **tol, msg=name)

    f_step, m_step = fsdp.optimizer_step(), meg.optimizer_step()
    norm = f_step[names.TRAIN_GRAD_NORM]
    assert m_step[names.TRAIN_GRAD_NORM] == pytest.approx(norm, **approx("values", 1e-5, norm))
    after_f = _full((f"mtp.{n}", p) for n, p in fsdp.module.mtp.named_parameters())
    after_m = {n: t for n, t in meg.full_state_dict() if n.startswith("mtp.")}
    moved = 0
    for name, tensor in after_f.items():
        tol = tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor)
        torch.testing.assert_close(after_m[name], tensor, **tol, msg=name)
        moved += int(not torch.equal(tensor, original[name]))
    assert moved == len(original)
    kinds = {kind: [n for n, _ in bucket] for kind, bucket in meg.export_buckets(kinds=("mtp",))}
    assert set(kinds) == {"mtp"} and sorted(kinds["mtp"]) == sorted(original)


@pytest.mark.parametrize(
    "mtp, layout, key",
    [
        (dict(num_depths=2), {}, "mtp.num_depths"),
        (dict(train=False), {}, "mtp.train"),
        (dict(mtp_only=True), {}, "mtp.mtp_only"),
    ],
)
def test_what_the_megatron_mtp_head_cannot_do_is_refused(mtp, layout, key):
    from areal_npu.train.megatron.mtp import check_mtp

    with pytest.raises(ConfigError) as err:
        check_mtp(MTPConfig(enabled=True, **mtp))
    assert err.value.key == key


def test_factory_builds_the_head_from_the_checkpoint_and_a_resume_continues_exactly(tmp_path):
    """``build_engine`` (``train.backend: megatron``) reads the head from the checkpoint it loads
    the policy from (here a new head, ``init_new_head``); a checkpoint carries ``mtp.*`` and the
    head's optimizer state, and a fresh engine built from it continues exactly."""
    from areal_npu.train.factory import build_engine
    from tests.support.megatron_tiny import save_tiny_qwen3_checkpoint

    path = save_tiny_qwen3_checkpoint(tmp_path / "model")
    train = megatron_config(packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(**OPTIM))
    new_head = MTPConfig(enabled=True, init_new_head=True, init_std=0.05)
    a = build_engine(train, path, new_head, pad_token_id=0)
    assert a.mtp is not None

    def step(engine, seed):
        samples = make_samples(seed=seed)
        for s, lp in zip(samples, engine.compute_logprobs(samples)):
            s.prox_logp = lp
        return engine.train_step(samples, PPOLoss())

    step(a, 0)
    saved = a.save_checkpoint(tmp_path / "ckpt")
    expected = step(a, 1)
    b = build_engine(train, saved, MTPConfig(enabled=True), pad_token_id=0)  # head from mtp.* in the file
    b.load_checkpoint(saved)
    got = step(b, 1)
    for key in (names.PPO_LOSS, names.MTP_LOSS, names.TRAIN_GRAD_NORM):
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key
    wa, wb = dict(a.full_state_dict()), dict(b.full_state_dict())
    assert any(n.startswith("mtp.") for n in wa) and sorted(wa) == sorted(wb)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=1e-7, msg=name)
