"""``train.packing.on_too_long=truncate`` in the FSDP2 engine: a sequence over the cap trains as its
first ``cap`` tokens everywhere (planner, packed layout, log-probs, PPO loss, MTP labels).

References: per-sequence unpacked forward passes on hand-cut ids, the naive decoupled-PPO formula on
hand-cut samples, and the MTP label count ``sum_i sum(loss_mask_i[:cap][2:])`` (depth 1 predicts
token t + 2, so a token carries MTP loss when it is trained and has two tokens before it).
"""

import dataclasses

import pytest
import torch

from areal_npu import names
from areal_npu.data.packing import PackingConfig
from areal_npu.data.sample import TrainSample
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import build_tiny_model
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import PPOLoss, SFTLoss
from areal_npu.train.optim import OptimConfig
from tests.support.device import float32_grad_tolerance
from tests.train.test_engine import (
    TINY,
    full_grads,
    make_samples,
    naive_decoupled_loss,
    reference_logprobs,
)

CAP = 12  # make_samples lengths are 7, 10, 13, 16, 19: the last three are cut


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def _engine(on_too_long="truncate", mtp=False):
    lm, head, _ = build_tiny_model(TINY)
    reference = lm.__class__(lm.config)
    reference.load_state_dict(lm.state_dict())
    packing = PackingConfig(max_tokens_per_mb=CAP, on_too_long=on_too_long)
    cfg = TrainEngineConfig(packing=packing, optim=OptimConfig(lr=1e-2, grad_clip=0.0))
    engine = FSDPEngine(lm, head if mtp else None, cfg, mtp_config=MTPConfig(enabled=mtp, train=mtp))
    return engine, reference


def _cut(sample):
    """The reference truncation, by hand: every per-token field keeps its first CAP rows."""
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    return TrainSample(**{k: (v[:CAP] if v is not None and v.dim() else v) for k, v in fields.items()})


def test_truncate_trains_on_the_first_cap_tokens_of_a_long_sequence():
    engine, reference = _engine()
    samples = make_samples()
    assert max(len(s.input_ids) for s in samples) > CAP
    prox = engine.compute_logprobs(samples)
    for s, lp in zip(samples, prox):
        cut = s.input_ids[:CAP]
        assert lp.shape == cut.shape  # log-probs exist only for the tokens that are trained
        torch.testing.assert_close(
            lp.double(), reference_logprobs(reference, cut).detach(), rtol=1e-5, atol=1e-5
        )
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())  # full-length samples, cap-length prox_logp
    assert stats[names.PACKING_TOKENS_PER_MB_MAX] <= CAP
    assert stats[names.PACKING_TRUNCATED_SEQUENCES] == sum(len(s.input_ids) > CAP for s in samples)
    assert stats[names.TRAIN_N_TOKENS] == sum(int(s.loss_mask[:CAP].sum()) for s in samples)
    reference.double()
    loss = naive_decoupled_loss(reference, [_cut(s) for s in samples])
    loss.backward()
    assert stats[names.PPO_LOSS] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    grads = full_grads(engine)
    tolerance = float32_grad_tolerance(engine.device)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads["lm." + name], param.grad, **tolerance, msg=name)


def test_truncate_cuts_mtp_labels_with_the_sequence():
    samples = [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples()]
    engine, _ = _engine(mtp=True)
    stats = engine.forward_backward(samples, SFTLoss())
    assert stats[names.mtp_count_key(1)] == sum(int(s.loss_mask[:CAP][2:].sum()) for s in samples)
    # the same loss as an engine that never sees the cut tokens (hand-cut samples, no truncation)
    uncut_engine, _ = _engine(on_too_long="error", mtp=True)
    expected = uncut_engine.forward_backward([_cut(s) for s in samples], SFTLoss())
    for key in (names.SFT_NLL, names.mtp_loss_key(1), names.mtp_count_key(1)):
        assert stats[key] == pytest.approx(expected[key], rel=1e-5), key


def test_error_mode_still_refuses_a_long_sequence():
    engine, _ = _engine(on_too_long="error")
    with pytest.raises(ValueError, match=r"sample 2 has length 13 > max_tokens_per_mb 12"):
        engine.compute_logprobs(make_samples())
