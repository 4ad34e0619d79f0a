"""Activation recomputation in the Megatron engine (``train.gradient_checkpointing``): Megatron's
full, uniform, one-layer recomputation of every decoder layer and of the MTP layer.

The reference is the same engine without recomputation: on a packed micro-batch of several
sequences (float32, MTP head on) the losses and every gradient (HF names) must agree, on one rank
and on TP=2 with sequence parallelism over two gloo ranks. That recomputation really happens is
checked by behaviour: every layer's core attention runs twice per forward+backward, and the
autograd graph saves fewer bytes (``saved_tensors_hooks``)."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

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

CAP = 64  # several of make_samples' sequences (7 .. 21 tokens) share each packed micro-batch
MTP = MTPConfig(enabled=True, train=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)


def _engine(recompute: bool, tp: int = 1, sequence_parallel: bool = False):
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
        packing=PackingConfig(max_tokens_per_mb=CAP),
        optim=OptimConfig(lr=1e-2, grad_clip=0.5, eps=1e-3),
        gradient_checkpointing=recompute,
    )
    cfg.megatron.sequence_parallel = sequence_parallel
    return MegatronEngine.from_hf_model(hf, cfg, mtp=head, mtp_config=copy.deepcopy(MTP))


def _step(engine):
    samples = make_samples(6)
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())
    return {"stats": stats, "grads": engine.hf_grads()}


def _assert_same(got, want, rtol, atol):
    """``rtol``, ``atol``: the CPU's; accelerators: :mod:`tests.support.device`."""
    for key in (names.PPO_LOSS, names.MTP_LOSS, names.mtp_acc_key(1), names.mtp_count_key(1)):
        assert got["stats"][key] == pytest.approx(
            want["stats"][key], **approx("values", rtol, want["stats"][key], atol)
        ), key
    assert want["stats"][names.MTP_LOSS] > 0
    assert sorted(got["grads"]) == sorted(want["grads"]) and any(n.startswith("mtp.") for n in want["grads"])
    for name, grad in want["grads"].items():
        assert grad.abs().sum() > 0, name
        tol = tolerance("grads", dict(rtol=rtol, atol=atol), grad)
        torch.testing.assert_close(got["grads"][name], grad, **tol, msg=name)


@pytest.fixture()
def one_rank():
    init_distributed()


def test_recomputation_is_configured_in_the_decoder_and_the_mtp_layer(one_rank):
    engine = _engine(True)
    for cfg in (engine.module.config, engine.module.decoder.config, engine.mtp.config):
        assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == (
            "full",
            "uniform",
            1,
        )
    assert _engine(False).module.config.recompute_granularity is None


def test_loss_and_every_gradient_equal_the_run_without_recomputation(one_rank):
    from areal_npu.data.packing import plan_micro_batches

    lengths = [len(s.input_ids) for s in make_samples(6)]
    plan = plan_micro_batches(lengths, PackingConfig(max_tokens_per_mb=CAP))
    assert max(len(mb) for mb in plan) >= 3  # a packed micro-batch of several sequences
    _assert_same(_step(_engine(True)), _step(_engine(False)), rtol=1e-6, atol=1e-8)


def _count_core_attention(engine):
    """Forward calls of every core attention (decoder layers and the MTP layer) during one
    forward+backward."""
    from areal_npu.train.megatron.attention import PackedCoreAttention

    calls = []
    modules = [
        m for m in (engine.module, engine.mtp) for m in m.modules() if isinstance(m, PackedCoreAttention)
    ]
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for m in modules]
    samples = make_samples(6)
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    before = len(calls)
    engine.forward_backward(samples, PPOLoss())
    for h in handles:
        h.remove()
    return len(modules), len(calls) - before


def test_every_layer_runs_its_forward_again_in_backward(one_rank):
    layers, plain = _count_core_attention(_engine(False))
    layers_r, recomputed = _count_core_attention(_engine(True))
    assert layers == layers_r == 3  # two decoder layers and the MTP layer
    assert plain > 0 and recomputed == 2 * plain


def saved_bytes(engine, n_tokens: int) -> int:
    """Activation bytes the autograd graph saves for backward in one training forward of the decoder and the
    MTP layer over a packed row of ``n_tokens`` tokens (sequences of 16)."""
    from areal_npu.data.packed_layout import pack_sequences
    from areal_npu.train.megatron.model import decoder_hidden_states
    from areal_npu.train.megatron.mtp import mtp_forward
    from areal_npu.train.megatron.packing import to_megatron

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (16,), generator=g) for _ in range(n_tokens // 16)]
    batch = pack_sequences(seqs, alignment=1)
    mb = to_megatron(batch, {}, 1, 0, None, engine.device)
    engine.module.train()
    engine.mtp.train()
    total = [0]
    weights = {p.untyped_storage().data_ptr() for m in (engine.module, engine.mtp) for p in m.parameters()}

    def pack(t):  # activations only: a saved weight is no extra memory
        if t.untyped_storage().data_ptr() not in weights:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden, rotary = decoder_hidden_states(
            engine.module, mb.input_ids, mb.position_ids, mb.params, with_rotary=True
        )
        weight = engine.module.embedding.word_embeddings.weight
        out = mtp_forward(engine.mtp, hidden, mb.input_ids, weight, rotary, mb.params)
    (hidden.sum() + out.sum()).backward()
    return total[0]


def test_the_graph_saves_fewer_activation_bytes(one_rank):
    with_, without = saved_bytes(_engine(True), 256), saved_bytes(_engine(False), 256)
    # a layer keeps its input [t, H] only, instead of its q/k/v, norms, MLP activations...
    assert 0 < with_ < without / 2, (with_, without)


def _worker(rank, path, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        out = _step(_engine(True, tp=2, sequence_parallel=True))
        if rank == 0:
            torch.save(out, path)


@pytest.mark.distributed
@pytest.mark.skipif(
    current_platform().device_type != "cpu" and current_platform().device_count() < 2,
    reason="two ranks need two accelerators on this machine",
)
def test_tp2_sequence_parallel_with_recomputation_equals_one_rank_without(tmp_path):
    start_processes(
        _worker,
        args=(str(tmp_path / "out.pt"), str(tmp_path / "rdv")),
        nprocs=2,
        join=True,
    )
    two = torch.load(tmp_path / "out.pt", weights_only=False)
    init_distributed()
    _assert_same(two, _step(_engine(False)), rtol=1e-4, atol=1e-7)
