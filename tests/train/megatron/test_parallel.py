"""Two gloo ranks (TP=2, CP=2, DP=2) equal one process: logits, log-probs, PPO loss, gradients
(under HF names) and the weights after an optimizer step; the vocab-parallel log-prob kernel on a
sharded head equals the unsharded reference, gradients included.

Not tested here: Megatron's own CP attention (Transformer Engine's ring attention, CUDA only) -- the
engine's CP attention is the all-gather form in ``attention.py``, which is what runs here. Sequence
parallelism and TP beyond the KV heads (gloo's reduce-scatter, torch >= 2.13): ``test_tp_kv_replicated.py``.
"""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from areal_npu import names  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.platform import current_platform  # noqa: E402
from areal_npu.train.dist import init_distributed, process_group  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import approx, test_device, tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, ppo_step_outputs, tiny_qwen3  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402

CAP = 24
ADAM_EPS = 1e-3


def _engine(tp, cp):
    from areal_npu.train.megatron.engine import MegatronEngine

    _, hf = tiny_qwen3()
    cfg = megatron_config(
        tp,
        cp,
        packing=PackingConfig(max_tokens_per_mb=CAP),
        optim=OptimConfig(lr=1e-2, grad_clip=0.05, eps=ADAM_EPS),
    )
    return MegatronEngine.from_hf_model(hf, cfg)


def _vocab_parallel_check(rank, tp):
    """Sharded head vs the full one: logp, entropy and the gradients of hidden and head."""
    import torch.distributed as dist
    from areal_npu.kernels.logprobs import naive_logprobs_entropy

    from areal_npu.train.megatron.logprobs import vocab_parallel_logprobs_entropy

    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(13, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(20, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 20, (13,), generator=g)
    targets[4] = -100
    up_lp, up_h = (
        torch.randn(13, generator=g, dtype=torch.float64),
        torch.randn(13, generator=g, dtype=torch.float64),
    )
    # on the platform's device (NCCL/HCCL take device tensors only); float64 there too
    hidden, weight, targets, up_lp, up_h = (
        t.to(test_device()) for t in (hidden, weight, targets, up_lp, up_h)
    )
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp_ref, ent_ref = naive_logprobs_entropy(h_ref, w_ref, targets, temperature=0.7)
    ((lp_ref * up_lp).sum() + (ent_ref * up_h).sum()).backward()
    h = hidden.clone().requires_grad_()
    w = weight.chunk(tp)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(
        h, w, targets, vocab_start=rank * 20 // tp, temperature=0.7, chunk_size=5, group=dist.group.WORLD
    )
    ((lp * up_lp).sum() + (ent * up_h).sum()).backward()
    grad_h = h.grad.clone()
    dist.all_reduce(grad_h)  # what copy_to_tensor_model_parallel_region's backward does
    torch.testing.assert_close(lp, lp_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_h, h_ref.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w.grad, w_ref.grad.chunk(tp)[rank], rtol=1e-10, atol=1e-10)


def _worker(rank, tp, cp, path, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        if tp == 2:
            _vocab_parallel_check(rank, tp)
        dp = 2 // (tp * cp)
        samples = make_samples(6)
        out = ppo_step_outputs(_engine(tp, cp), samples[rank::dp] if dp > 1 else samples)
        if rank == 0:
            torch.save(out, path)


def _two_ranks_fit() -> bool:
    plat = current_platform()
    return plat.device_type == "cpu" or plat.device_count() >= 2


@pytest.mark.skipif(not _two_ranks_fit(), reason="two ranks need two accelerators on this machine")
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "cp2", "dp2"])
def test_two_gloo_ranks_equal_one_process(tmp_path, tp, cp):
    start_processes(
        _worker,
        args=(tp, cp, str(tmp_path / "out.pt"), str(tmp_path / "rdv")),
        nprocs=2,
        join=True,
    )
    two = torch.load(tmp_path / "out.pt", weights_only=False)
    init_distributed()
    one = ppo_step_outputs(_engine(1, 1), make_samples(6))
    for got, want in zip(two["logits"], one["logits"]):
        torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))
    if cp * tp > 1:  # a DP rank sees half the batch; TP/CP ranks see all of it
        for got, want in zip(two["prox"], one["prox"]):
            torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-6), want))
    assert two["stats"][names.PPO_LOSS] == pytest.approx(
        one["stats"][names.PPO_LOSS], **approx("values", 1e-5, one["stats"][names.PPO_LOSS])
    )
    assert two["stats"][names.TRAIN_GRAD_NORM] == pytest.approx(
        one["stats"][names.TRAIN_GRAD_NORM], **approx("values", 1e-5, one["stats"][names.TRAIN_GRAD_NORM])
    )
    assert two["stats"][names.TRAIN_N_TOKENS] == one["stats"][names.TRAIN_N_TOKENS]
    assert sorted(two["grads"]) == sorted(one["grads"])
    for name, grad in one["grads"].items():
        torch.testing.assert_close(
            two["grads"][name], grad, **tolerance("grads", dict(rtol=1e-4, atol=1e-7), grad), msg=name
        )
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(
            two["weights"][name], tensor, **tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor), msg=name
        )
