"""The tensor-parallel Gated DeltaNet (``areal_npu/train/megatron/gdn.py``) against transformers'
``Qwen3_5GatedDeltaNet`` holding every head, run on each segment alone: output, input gradient and
every weight gradient, on one rank and split over two gloo ranks (TP=2)."""

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron]

from areal_npu.train.dist import process_group  # noqa: E402

SEGMENTS = (5, 9, 3)  # one packed row; each segment must start from a zero state


def _config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=48, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, vocab_size=32,
    )  # fmt: skip


def _reference():
    """(full module, its state, input, upstream gradient, per-segment output, grads of input and weights)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    full = Qwen3_5GatedDeltaNet(_config(), 0).double()
    with torch.no_grad():
        for p in full.parameters():  # away from the init (norm = 1, ...): a mis-sliced weight shows
            p.add_(0.3 * torch.randn_like(p))
    state = {n: t.detach().clone() for n, t in full.state_dict().items()}
    hidden = torch.randn(sum(SEGMENTS), 48, dtype=torch.float64)
    upstream = torch.randn_like(hidden)
    x = hidden.clone().requires_grad_()
    outs, start = [], 0
    for n in SEGMENTS:  # each segment alone, no packing at all
        outs.append(full(x[None, start : start + n])[0])
        start += n
    out = torch.cat(outs)
    (out * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    return state, hidden, upstream, out.detach(), x.grad, grads


def _parallel_grads(rank, tp, group=None):
    from areal_npu.train.megatron.gdn import ParallelGatedDeltaNet, shard_gdn

    state, hidden, upstream, _, _, _ = _reference()
    layer = ParallelGatedDeltaNet(_config(), 0, tp_size=tp, tp_group=group, dtype=torch.float64)
    layer.inner.load_state_dict(shard_gdn(state, _config(), rank, tp), strict=True)
    x = hidden.clone().requires_grad_()
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()])
    out = layer(x, cu)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.inner.named_parameters()}


def _worker(rank, path, init_file):
    import torch.distributed as dist

    with process_group(rank, 2, f"file://{init_file}"):
        got = _parallel_grads(rank, 2, dist.group.WORLD)
        torch.save(got, f"{path}.{rank}")


def test_one_rank_equals_the_layer_run_on_each_segment():
    _, _, _, out, x_grad, grads = _reference()
    got_out, got_x, got_grads = _parallel_grads(0, 1)
    torch.testing.assert_close(got_out, out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got_x, x_grad, rtol=1e-9, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.distributed
def test_two_tp_ranks_equal_the_layer_with_every_head(tmp_path):
    from areal_npu.train.megatron.gdn import TP_PARTIAL, unshard_gdn

    mp.start_processes(_worker, args=(str(tmp_path / "out"), str(tmp_path / "rdv")), nprocs=2, join=True,
                       start_method="spawn")  # fmt: skip
    # float64; the sums over TP add in another order than over every head at once
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    _, _, _, out, x_grad, grads = _reference()
    for got_out, got_x, _ in ranks:  # summed over TP: every rank holds the layer's output
        torch.testing.assert_close(got_out, out, rtol=1e-7, atol=1e-8)
        torch.testing.assert_close(got_x, x_grad, rtol=1e-7, atol=1e-8)
    merged = unshard_gdn([g for _, _, g in ranks], _config())
    for name in TP_PARTIAL:  # each rank's part of the shared norm's gradient
        merged[name] = ranks[0][2][name] + ranks[1][2][name]
    assert sorted(merged) == sorted(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-7, atol=1e-8, msg=name)


def test_shards_put_back_are_the_checkpoint_and_bad_splits_are_refused():
    from areal_npu.train.megatron.gdn import check_gdn_tp, shard_gdn, unshard_gdn

    state = _reference()[0]
    for tp in (1, 2):
        shards = [shard_gdn(state, _config(), r, tp) for r in range(tp)]
        if tp == 2:  # halves of every per-head tensor
            assert shards[0]["A_log"].shape == (2,) and shards[0]["out_proj.weight"].shape == (48, 24)
        back = unshard_gdn(shards, _config())
        assert sorted(back) == sorted(state)
        for name, tensor in state.items():
            assert torch.equal(back[name], tensor), (tp, name)
    with pytest.raises(ValueError, match="divisible by tp_size=4"):
        check_gdn_tp(_config(), 4)
    with pytest.raises(KeyError, match="unknown Gated DeltaNet tensor"):
        shard_gdn({"bogus.weight": torch.zeros(1)}, _config(), 0, 1)
