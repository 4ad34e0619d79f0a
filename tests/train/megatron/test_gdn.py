"""The tensor-parallel Gated DeltaNet (``areal_npu/train/megatron/gdn.py``) against transformers'
``Qwen3_5GatedDeltaNet`` holding every head, run on each segment alone: output, input gradient and
every weight gradient, on one rank and split over gloo ranks: TP = 2 (heads), with sequence
parallelism (each rank holds half the row), CP = 2 (zigzag shares of the row, heads split once
more) and TP = 2 x CP = 2 with sequence parallelism."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron]

from areal_npu.platform import current_platform  # noqa: E402
from areal_npu.train.dist import process_group  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402

SEGMENTS = (5, 9, 3)  # one packed row; each segment must start from a zero state
CP_SEGMENTS = (8, 12, 4)  # multiples of 2 x cp (the packer pads them so)


def _config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=48, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, vocab_size=32,
    )  # fmt: skip


def _reference(segments=SEGMENTS):
    """(full module, its state, input, upstream gradient, per-segment output, grads of input and weights)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    full = Qwen3_5GatedDeltaNet(_config(), 0).double()
    with torch.no_grad():
        for p in full.parameters():  # away from the init (norm = 1, ...): a mis-sliced weight shows
            p.add_(0.3 * torch.randn_like(p))
    state = {n: t.detach().clone() for n, t in full.state_dict().items()}
    hidden = torch.randn(sum(segments), 48, dtype=torch.float64)
    upstream = torch.randn_like(hidden)
    x = hidden.clone().requires_grad_()
    outs, start = [], 0
    for n in segments:  # each segment alone, no packing at all
        outs.append(full(x[None, start : start + n])[0])
        start += n
    out = torch.cat(outs)
    (out * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    return state, hidden, upstream, out.detach(), x.grad, grads


def _share(t, cu, tp_rank, tp, cp_rank, cp, sp):
    from areal_npu.data.context_parallel import cp_split

    t = cp_split(t, cu, cp, cp_rank)
    return t.chunk(tp)[tp_rank] if sp else t


def _parallel_grads(rank, tp=1, cp=1, sp=False, groups=(None, None), segments=SEGMENTS):
    """(output, input gradient, weight gradients) of global ``rank`` (TP rank fastest, as Megatron
    orders ranks), fed its share of the row: the zigzag share over CP, then with ``sp`` its
    contiguous part of that over TP."""
    from areal_npu.train.megatron.gdn import ParallelGatedDeltaNet, shard_gdn

    tp_rank, cp_rank = rank % tp, rank // tp
    state, hidden, upstream, _, _, _ = _reference(segments)
    layer = ParallelGatedDeltaNet(_config(), 0, tp, groups[0], torch.float64, sequence_parallel=sp,
                                  cp_size=cp, cp_group=groups[1])  # fmt: skip
    layer.inner.load_state_dict(shard_gdn(state, _config(), tp_rank, tp), strict=True)
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()])
    x = _share(hidden, cu, tp_rank, tp, cp_rank, cp, sp).clone().requires_grad_()
    out = layer(x, cu)
    (out * _share(upstream, cu, tp_rank, tp, cp_rank, cp, sp)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.inner.named_parameters()}


def _worker(rank, tp, cp, sp, path, init_file):
    import torch.distributed as dist

    with process_group(rank, tp * cp, f"file://{init_file}"):
        tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
        cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
        groups = (tp_groups[rank // tp], cp_groups[rank % tp])
        got = _parallel_grads(rank, tp, cp, sp, groups, CP_SEGMENTS)
        torch.save(got, f"{path}.{rank}")


def test_one_rank_equals_the_layer_run_on_each_segment():
    _, _, _, out, x_grad, grads = _reference()
    got_out, got_x, got_grads = _parallel_grads(0)
    torch.testing.assert_close(got_out, out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got_x, x_grad, rtol=1e-9, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.distributed
@pytest.mark.skipif(current_platform().device_type != "cpu", reason="CPU tensors on gloo ranks")
@pytest.mark.parametrize(
    "tp, cp, sp",
    [(2, 1, False), (2, 1, True), (1, 2, False), (2, 2, True)],
    ids=["tp2", "tp2-sp", "cp2", "tp2-cp2-sp"],
)
def test_tp_and_cp_ranks_equal_the_layer_with_every_head(tmp_path, tp, cp, sp):
    """Each rank's output and input gradient are the reference's on its share of the row; the CP
    ranks' weight gradients (each from the heads it computed) sum to its TP shard's, which put back
    together are the reference's."""
    from areal_npu.train.megatron.gdn import TP_PARTIAL, unshard_gdn

    world = tp * cp
    start_processes(_worker, args=(tp, cp, sp, str(tmp_path / "out"), str(tmp_path / "rdv")), nprocs=world,
                       join=True)  # fmt: skip
    # float64; the sums over ranks add in another order than over every head at once
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(world)]
    _, hidden, _, out, x_grad, grads = _reference(CP_SEGMENTS)
    cu = torch.tensor([0, *torch.tensor(CP_SEGMENTS).cumsum(0).tolist()])
    for rank, (got_out, got_x, _) in enumerate(ranks):
        share = dict(cu=cu, tp_rank=rank % tp, tp=tp, cp_rank=rank // tp, cp=cp, sp=sp)
        torch.testing.assert_close(got_out, _share(out, **share), rtol=1e-7, atol=1e-8)
        torch.testing.assert_close(got_x, _share(x_grad, **share), rtol=1e-7, atol=1e-8)
    per_tp = [{n: sum(ranks[c * tp + t][2][n] for c in range(cp)) for n in ranks[0][2]} for t in range(tp)]
    merged = unshard_gdn(per_tp, _config())
    for name in TP_PARTIAL:  # each rank's part of the shared norm's gradient
        merged[name] = sum(r[2][name] for r in ranks)
    assert sorted(merged) == sorted(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-7, atol=1e-8, msg=name)


def test_shards_put_back_are_the_checkpoint_and_bad_splits_are_refused():
    from areal_npu.train.megatron.gdn import check_gdn_tp, shard_gdn, unshard_gdn

    state = _reference()[0]
    for tp in (1, 2):
        shards = [shard_gdn(state, _config(), r, tp) for r in range(tp)]
        if tp == 2:  # halves of every per-head tensor
            assert shards[0]["A_log"].shape == (4,) and shards[0]["out_proj.weight"].shape == (48, 48)
        back = unshard_gdn(shards, _config())
        assert sorted(back) == sorted(state)
        for name, tensor in state.items():
            assert torch.equal(back[name], tensor), (tp, name)
    with pytest.raises(ValueError, match="divisible by tp_size=8"):
        check_gdn_tp(_config(), 8)
    with pytest.raises(ValueError, match="divisible by tp_size=4 x cp_size=2"):
        check_gdn_tp(_config(), 4, 2)
    with pytest.raises(KeyError, match="unknown Gated DeltaNet tensor"):
        shard_gdn({"bogus.weight": torch.zeros(1)}, _config(), 0, 1)
