"""TP larger than the KV heads, with sequence parallelism: a tiny Qwen3 with one KV head (four query
heads) on TP=2 with ``sequence_parallel`` over two gloo ranks equals the same model in one process --
logits, log-probs, PPO loss, gradients (HF names), weights after an optimizer step -- and its HF
export before any step is the original checkpoint. (One two-process run covers both features:
each spawn costs tens of seconds of CI.)

Megatron-Core 0.16.1 (``SelfAttention.get_query_key_value_tensors``) still splits the fused QKV weight
evenly by rows; each rank all-gathers the QKV *output* over TP, keeps its group's key/value (so the
KV head is replicated in compute, not in the weights) and its own query heads. The backward of that
all-gather is a reduce-scatter, which gloo runs in this torch (2.13).

Sequence parallelism: norms, residuals and the embedding output hold this rank's half of the packed
tokens; ``linear_qkv`` / ``linear_fc1`` all-gather their input, ``linear_proj`` / ``linear_fc2``
reduce-scatter their output (gloo has both collectives here), the norms' weight gradients are
partial over TP (all-reduced by the engine), and the decoder output is all-gathered before the
vocabulary-parallel head.
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
from tests.support.device import approx, tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, ppo_step_outputs, tiny_qwen3  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402

ONE_KV_HEAD = dict(num_attention_heads=4, num_key_value_heads=1)


def _engine(tp):
    from areal_npu.train.megatron.engine import MegatronEngine

    _, hf = tiny_qwen3(**ONE_KV_HEAD)
    cfg = megatron_config(
        tp, packing=PackingConfig(max_tokens_per_mb=24), optim=OptimConfig(lr=1e-2, grad_clip=0.05, eps=1e-3)
    )
    cfg.megatron.sequence_parallel = tp > 1
    return MegatronEngine.from_hf_model(hf, cfg), hf


def _run(tp):
    engine, hf = _engine(tp)
    exported = {n: t.clone() for n, t in engine.full_state_dict()}  # replicated ones alias the params
    from areal_npu.data.packed_layout import pack_sequences
    from areal_npu.train.megatron.model import decoder_hidden_states
    from areal_npu.train.megatron.packing import to_megatron

    batch = pack_sequences(
        [s.input_ids for s in make_samples(3, seed=5)], alignment=engine.config.packing.alignment
    )
    mb = to_megatron(batch, {}, 1, 0, engine.cp_group, engine.device)
    with torch.no_grad():
        hidden = decoder_hidden_states(engine.module, mb.input_ids, mb.position_ids, mb.params)
    assert hidden.shape[0] * tp == len(mb.input_ids)  # sequence parallel: this rank's share of the tokens
    return {"original": hf.state_dict(), "exported": exported, **ppo_step_outputs(engine, make_samples(6))}


def _worker(rank, path, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        out = _run(2)
        if rank == 0:
            torch.save(out, path)


def test_layout_check_accepts_tp_a_multiple_of_kv_heads():
    """Megatron's rule: KV heads a multiple *or* a divisor of TP; query heads split evenly."""
    from areal_npu.train.megatron.model import check_layout

    config, _ = tiny_qwen3(**ONE_KV_HEAD)
    check_layout(config, 2)
    check_layout(config, 4)
    config3, _ = tiny_qwen3(num_attention_heads=6, num_key_value_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="num_key_value_heads=3 and tp_size=2"):
        check_layout(config3, 2)  # 6 query heads split, but 3 KV heads neither split nor replicate


@pytest.mark.skipif(
    current_platform().device_type != "cpu" and current_platform().device_count() < 2,
    reason="two ranks need two accelerators on this machine",
)
def test_tp2_with_one_kv_head_and_sequence_parallel_equals_one_process(tmp_path):
    start_processes(
        _worker,
        args=(str(tmp_path / "out.pt"), str(tmp_path / "rdv")),
        nprocs=2,
        join=True,
    )
    two = torch.load(tmp_path / "out.pt", weights_only=False)
    init_distributed()
    one = _run(1)
    assert sorted(two["exported"]) == sorted(two["original"])
    for name, tensor in two["original"].items():  # a no-op round trip through the TP shards
        torch.testing.assert_close(two["exported"][name], tensor, rtol=0, atol=0, msg=name)
    for got, want in zip(two["logits"], one["logits"]):
        torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))
    for got, want in zip(two["prox"], one["prox"]):
        torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-6), want))
    assert two["stats"][names.PPO_LOSS] == pytest.approx(
        one["stats"][names.PPO_LOSS], **approx("values", 1e-5, one["stats"][names.PPO_LOSS])
    )
    assert two["stats"][names.TRAIN_GRAD_NORM] == pytest.approx(
        one["stats"][names.TRAIN_GRAD_NORM], **approx("values", 1e-5, one["stats"][names.TRAIN_GRAD_NORM])
    )
    assert sorted(two["grads"]) == sorted(one["grads"])
    for name, grad in one["grads"].items():
        torch.testing.assert_close(
            two["grads"][name], grad, **tolerance("grads", dict(rtol=1e-4, atol=1e-7), grad), msg=name
        )
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(
            two["weights"][name], tensor, **tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor), msg=name
        )
