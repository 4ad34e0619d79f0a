"""The Megatron engine's MTP head on TP=2 with sequence parallelism, and on CP=2 (targets cut from
the whole row in zigzag order), over two gloo ranks equals one process: MTP loss and accuracy, PPO loss, every gradient (policy and ``mtp.*``, HF names), both
groups' norms and the weights after an optimizer step. The head's layer is TP-sharded (gated QKV by
query groups, ``eh_proj`` by rows), its embedding lookup and loss run on the vocabulary shards."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from areal_npu import names  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights  # noqa: E402
from areal_npu.platform import current_platform  # noqa: E402
from areal_npu.train.dist import init_distributed, process_group  # noqa: E402
from areal_npu.train.losses import PPOLoss  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import approx, tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, tiny_qwen3  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402


def _run(tp, cp=1):
    from areal_npu.train.megatron.engine import MegatronEngine

    config, hf = tiny_qwen3()
    head = Qwen35MTP(config, 1)
    g = torch.Generator().manual_seed(11)
    init_mtp_weights(head, std=0.08, generator=g)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:  # zero-centred norms away from 0
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    cfg = megatron_config(
        tp,
        cp,
        packing=PackingConfig(max_tokens_per_mb=24),
        optim=OptimConfig(lr=1e-2, grad_clip=0.5, eps=1e-3),
    )
    cfg.megatron.sequence_parallel = tp > 1
    mtp = MTPConfig(enabled=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)
    engine = MegatronEngine.from_hf_model(hf, cfg, mtp=head, mtp_config=mtp)
    samples = make_samples(6)
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())
    grads = engine.hf_grads()
    mtp_norm = engine.grad_norm(mtp=True)
    stats.update(engine.optimizer_step())
    return {"stats": stats, "grads": grads, "mtp_norm": mtp_norm, "weights": dict(engine.full_state_dict())}


def _worker(rank, tp, cp, path, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        out = _run(tp, cp)
        if rank == 0:
            torch.save(out, path)


@pytest.mark.skipif(
    current_platform().device_type != "cpu" and current_platform().device_count() < 2,
    reason="two ranks need two accelerators on this machine",
)
@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)], ids=["tp2-sp", "cp2"])
def test_mtp_on_two_ranks_equals_one_process(tmp_path, tp, cp):
    start_processes(
        _worker,
        args=(tp, cp, str(tmp_path / "out.pt"), str(tmp_path / "rdv")),
        nprocs=2,
        join=True,
    )
    two = torch.load(tmp_path / "out.pt", weights_only=False)
    init_distributed()
    one = _run(1)
    for key in (
        names.MTP_LOSS,
        names.mtp_loss_key(1),
        names.mtp_acc_key(1),
        names.mtp_count_key(1),
        names.PPO_LOSS,
        names.TRAIN_GRAD_NORM,
    ):
        assert two["stats"][key] == pytest.approx(
            one["stats"][key], **approx("values", 1e-5, one["stats"][key])
        ), key
    assert one["stats"][names.MTP_LOSS] > 0 and two["mtp_norm"] == pytest.approx(
        one["mtp_norm"], **approx("values", 1e-5, one["mtp_norm"])
    )
    assert sorted(two["grads"]) == sorted(one["grads"]) and any(n.startswith("mtp.") for n in one["grads"])
    for name, grad in one["grads"].items():
        torch.testing.assert_close(
            two["grads"][name], grad, **tolerance("grads", dict(rtol=1e-4, atol=1e-7), grad), msg=name
        )
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(
            two["weights"][name], tensor, **tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor), msg=name
        )
