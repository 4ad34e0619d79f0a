"""bf16 compute with fp32 master weights and the distributed optimizer (ZeRO-1) in the Megatron
engine (the FSDP2 analogue: tests/train/test_engine_precision.py).

References: the float32 engine on the same batch (a bf16 update within bf16 error), AdamW's first
step written out (a change below bf16's resolution survives), one process against two gloo DP
ranks with sharded optimizer state (fp32 to 1e-5, bf16 within bf16 error), 12 bytes per parameter
split over the ranks, and an uninterrupted run against a resumed one (bit-equal).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu import names  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.data.sample import TrainSample  # noqa: E402
from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights  # noqa: E402
from areal_npu.platform import current_platform  # noqa: E402
from areal_npu.train.dist import init_distributed, process_group  # noqa: E402
from areal_npu.train.losses import SFTLoss  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, tiny_qwen3  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402

two_ranks = pytest.mark.skipif(
    current_platform().device_type != "cpu" and current_platform().device_count() < 2,
    reason="two ranks need two accelerators on this machine",
)


def engine_for(dtype="float32", lr=1e-2, adam_eps=1e-3, mtp=True, tp=1, schedule="constant", clip=0.0):
    from areal_npu.train.megatron.engine import MegatronEngine

    config, hf = tiny_qwen3()
    head = Qwen35MTP(config, 1)
    init_mtp_weights(head, std=0.08, generator=torch.Generator().manual_seed(11))
    optim = OptimConfig(lr=lr, grad_clip=clip, eps=adam_eps, schedule=schedule, total_steps=10)
    cfg = megatron_config(tp, dtype=dtype, packing=PackingConfig(max_tokens_per_mb=24), optim=optim)
    mtp_cfg = MTPConfig(enabled=mtp, num_depths=1, loss_scale=0.3, lr_scale=0.5)
    return MegatronEngine.from_hf_model(hf, cfg, mtp=head if mtp else None, mtp_config=mtp_cfg)


def sft_samples(n=6, seed=0):
    return [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples(n, seed)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------- one process


@pytest.fixture()
def one_process():
    init_distributed()


def test_bf16_engine_computes_in_bf16_and_keeps_fp32_masters_grads_and_states(one_process):
    engine = engine_for("bfloat16")
    seen = []
    qkv = engine.module.decoder.layers[0].self_attention.linear_qkv
    qkv.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
    stats = engine.forward_backward(sft_samples(), SFTLoss())
    assert stats[names.MTP_LOSS] > 0
    params = engine.named_mcore_parameters()
    assert params and all(p.dtype == torch.bfloat16 and p.grad is None for p in params.values())
    opt = engine.optimizer
    for i in range(2):  # the policy and the MTP head
        assert opt.groups[i].master.dtype == torch.float32
        assert all(g.dtype == torch.float32 for g in opt.grads(i).values())
        assert any(bool(g.abs().sum() > 0) for g in opt.grads(i).values())
    engine.optimizer_step()
    states = list(opt.optimizer.state.values())
    assert len(states) == 2 and all(
        s[k].dtype == torch.float32 for s in states for k in ("exp_avg", "exp_avg_sq")
    )
    assert all(t.dtype == torch.float32 for _, t in engine.full_state_dict())  # what checkpoints save
    exported = [t for _, bucket in engine.export_buckets() for _, t in bucket]
    assert exported and all(t.dtype == torch.bfloat16 for t in exported)  # what rollouts get
    masters = {**opt.masters(0), **{"mtp_layer." + n: t for n, t in opt.masters(1).items()}}
    assert all(torch.equal(params[n], masters[n].bfloat16()) for n in params)  # refreshed from masters
    assert engine.compute_logprobs(sft_samples(2))[0].dtype == torch.float32
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}  # activations and weights


def test_bf16_update_equals_fp32_update_within_bf16_error(one_process):
    """One step from the same weights on the same batch; a large Adam eps makes the update nearly
    linear in the gradient, so it compares the gradients: each tensor's update within 7.5% of the
    float32 engine's in norm, the loss to 1%. Measured worst: 4.2% with float32 logits, 5.8% (the
    MTP layer's k_norm) with the head's bf16 GEMM rounding its output to bf16 as on the CPU and NPU
    (:mod:`areal_npu.train.megatron.logprobs`). lr 0.1: the update (~1e-2 g) stays far above the
    fp32 resolution of weights near 1 (at lr 1e-3 the norms' updates are a few fp32 ulps)."""
    samples = sft_samples()
    before = dict(engine_for("float32").full_state_dict())
    updates, losses = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = engine_for(dtype, lr=0.1, adam_eps=10.0)
        stats = engine.train_step(samples, SFTLoss())
        losses[dtype] = (stats[names.SFT_NLL], stats[names.MTP_LOSS])
        updates[dtype] = {n: t - before[n] for n, t in engine.full_state_dict()}
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=1e-2)
    assert any(n.startswith("mtp.") for n in updates["float32"])
    for name, ref in updates["float32"].items():
        assert ref.norm() > 0, name
        assert rel(updates["bfloat16"][name], ref) <= 0.075, (name, rel(updates["bfloat16"][name], ref))


def test_an_update_below_bf16_resolution_is_not_lost(one_process):
    """lr = 1e-6, eps = 1e-8: AdamW's first step moves every weight with |g| >> eps by lr * sign(g)
    (to 1e-4 relative), for most weights below half a bf16 ulp. The fp32 master keeps it; over three
    steps the masters move where a plain AdamW on bf16 parameters (the reference, fed the same
    gradients) leaves most weights where they were."""
    lr = 1e-6
    engine = engine_for("bfloat16", lr=lr, adam_eps=1e-8, mtp=False)
    start = {n: t.clone() for n, t in engine.optimizer.masters(0).items()}
    bf16 = {n: t.bfloat16().requires_grad_() for n, t in start.items()}
    reference = torch.optim.AdamW(list(bf16.values()), lr=lr, eps=1e-8, weight_decay=0.0)
    for step in range(3):
        before = {n: t.clone() for n, t in engine.optimizer.masters(0).items()}
        engine.forward_backward(sft_samples(), SFTLoss())
        grads = {n: g.clone() for n, g in engine.optimizer.grads(0).items()}
        engine.optimizer_step()
        for n, g in grads.items():
            bf16[n].grad = g.bfloat16()
        reference.step()
        if step == 0:  # AdamW's first step written out
            after = engine.optimizer.masters(0)
            checked = moved = 0
            for name, g in grads.items():
                p0, p1, big = before[name], after[name], g.abs() > 1e-4
                ulp32 = torch.finfo(torch.float32).eps * p0.abs()
                expected = p0 - lr * torch.sign(g)
                assert torch.all((p1 - expected).abs()[big] <= lr * 1e-3 + ulp32[big]), name
                checked += int(big.sum())
                moved += int((p1 != p0)[big].sum())
            assert checked > 1000 and moved == checked
    final = engine.optimizer.masters(0)
    n = sum(t.numel() for t in start.values())
    master_moved = sum(int((final[k] != start[k]).sum()) for k in start)
    bf16_moved = sum(int((bf16[k].detach() != start[k].bfloat16()).sum()) for k in start)
    # measured: 84% of the masters moved (unused embedding rows get no gradient), 1.6% of the bf16 weights
    assert master_moved > 0.5 * n and bf16_moved < 0.1 * master_moved, (master_moved, bf16_moved, n)


# ------------------------------------------------------------------------------- two DP ranks


CLIP = 0.05  # below the steps' gradient norms (~0.1-1): both steps are clipped


def _two_steps(dtype, dp_rank=0, dp=1):
    """Two SFT steps (MTP head joint, clipped), each DP rank on its share of the batch."""
    engine = engine_for(dtype, lr=1e-2, clip=CLIP)
    norms = []
    for seed in (0, 1):
        stats = engine.train_step(sft_samples(6, seed)[dp_rank::dp], SFTLoss())
        norms.append(stats[names.TRAIN_GRAD_NORM])
    return {"weights": dict(engine.full_state_dict()), "state_bytes": engine.optimizer.state_bytes(),
            "norms": norms, "buffers": [g.grad.numel() for g in engine.optimizer.groups]}  # fmt: skip


def _recording(calls: list, fn):
    def record(tensor, *args, **kwargs):
        calls.append((fn.__name__, args[0].numel() if fn.__name__ == "reduce_scatter_tensor" else tensor.numel()))
        return fn(tensor, *args, **kwargs)

    return record


def _dp_worker(rank, out, init_file):
    import torch.distributed as dist

    with process_group(rank, 2, f"file://{init_file}"):
        result = {"float32": _two_steps("float32", rank, 2)}
        calls = []  # the bf16 run's sums: (collective, elements summed)
        plain = dist.all_reduce, dist.reduce_scatter_tensor
        dist.all_reduce, dist.reduce_scatter_tensor = (_recording(calls, fn) for fn in plain)
        try:
            result["bfloat16"] = _two_steps("bfloat16", rank, 2)
        finally:
            dist.all_reduce, dist.reduce_scatter_tensor = plain
        result["calls"] = calls
        torch.save(result, f"{out}.{rank}")


@two_ranks
def test_two_dp_ranks_with_sharded_optimizer_state_equal_one_process(tmp_path):
    out = str(tmp_path / "out.pt")
    start_processes(_dp_worker, args=(out, str(tmp_path / "rdv")), nprocs=2, join=True)
    two = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    init_distributed()
    before = dict(engine_for("float32").full_state_dict())
    for dtype in ("float32", "bfloat16"):
        one = _two_steps(dtype)
        assert any(n.startswith("mtp.") for n in one["weights"])
        for name, ref in one["weights"].items():
            for r in range(2):
                got = two[r][dtype]["weights"][name]
                if dtype == "float32":
                    tol = tolerance("weights", dict(rtol=1e-5, atol=1e-6), ref)
                    torch.testing.assert_close(got, ref, **tol, msg=name)
                else:  # bf16 compute on other packings: the updates agree within bf16 error
                    assert rel(got - before[name], ref - before[name]) <= 0.05, name
        # masters + two moments: 12 bytes a parameter, split over the ranks (padding: < 12 bytes a group)
        per_rank = [two[r][dtype]["state_bytes"] for r in range(2)]
        assert per_rank[0] == per_rank[1] and abs(per_rank[0] - one["state_bytes"] / 2) <= 24
        n_params = sum(t.numel() for t in one["weights"].values())
        assert one["state_bytes"] == 12 * n_params
        for r in range(2):  # the norm summed from the ranks' slices is the whole gradient's
            assert min(one["norms"]) > CLIP
            assert two[r][dtype]["norms"] == pytest.approx(one["norms"], rel=1e-5 if dtype == "float32" else 0.05)
    # the gradients are reduce-scattered, as Megatron's DistributedOptimizer does, not all-reduced:
    # per step each group's whole fp32 buffer (policy, MTP head) once; all-reduces carry norms only
    for r in range(2):
        calls = two[r]["calls"]
        scattered = [n for name, n in calls if name == "reduce_scatter_tensor"]
        assert scattered == two[r]["bfloat16"]["buffers"] * 2, calls
        assert max(n for name, n in calls if name == "all_reduce") <= 2, calls


def _resume_worker(rank, root, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        a = engine_for("bfloat16", lr=1e-2, schedule="cosine")
        a.train_step(sft_samples(6, 0)[rank::2], SFTLoss())
        saved = a.save_checkpoint(root)
        moments = [{k: a.optimizer.optimizer.state[g.master][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                   for g in a.optimizer.groups]  # fmt: skip
        expected = a.train_step(sft_samples(6, 1)[rank::2], SFTLoss())
        b = engine_for("bfloat16", lr=1e-2, schedule="cosine")
        b.load_checkpoint(saved)
        got = b.train_step(sft_samples(6, 1)[rank::2], SFTLoss())
        wa, wb = dict(a.full_state_dict()), dict(b.full_state_dict())
        pa, pb = a.named_mcore_parameters(), b.named_mcore_parameters()
        equal = all(torch.equal(wa[n], wb[n]) for n in wa) and all(torch.equal(pa[n], pb[n]) for n in pa)
        torch.save(
            {"equal": equal, "stats": (expected, got), "saved": str(saved), "moments": moments},
            f"{root}/out.{rank}",
        )


@two_ranks
def test_resume_of_sharded_bf16_state_continues_exactly_and_reshards(tmp_path):
    """dp = 2, bf16, sharded moments: save -> resume -> step is bit-equal to the uninterrupted step;
    the same checkpoint resumed by one process holds the two ranks' slices joined."""
    root = tmp_path / "ckpt"
    start_processes(_resume_worker, args=(str(root), str(tmp_path / "rdv")), nprocs=2, join=True)
    outs = [torch.load(root / f"out.{r}", weights_only=False) for r in range(2)]
    for out in outs:
        expected, got = out["stats"]
        assert (
            out["equal"]
            and got[names.SFT_NLL] == expected[names.SFT_NLL]
            and got[names.TRAIN_LR] == expected[names.TRAIN_LR]
        )
    saved = outs[0]["saved"]
    init_distributed()
    one = engine_for("bfloat16", lr=1e-2, schedule="cosine")
    one.load_checkpoint(saved)
    for i, group in enumerate(one.optimizer.groups):
        state = one.optimizer.optimizer.state[group.master]
        for key in ("exp_avg", "exp_avg_sq"):
            joined = torch.cat([out["moments"][i][key] for out in outs])[: group.numel]  # the ranks' slices
            assert joined.abs().sum() > 0 and torch.equal(state[key][: group.numel], joined), key
        assert float(state["step"]) == 1.0
    assert one.version == 1


def _tp_worker(rank, out, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        engine = engine_for("bfloat16", lr=1e-2, tp=2, clip=CLIP)  # as _two_steps, its reference
        for seed in (0, 1):
            engine.train_step(sft_samples(6, seed), SFTLoss())
        weights = dict(engine.full_state_dict())
        if rank == 0:
            torch.save(weights, out)


@two_ranks
def test_bf16_on_tp2_equals_one_rank_within_bf16_error(tmp_path):
    """TP = 2 (the per-head q/k norms' partial gradients all-reduced in fp32) x DP = 1 in bf16, two
    steps with the MTP head: every tensor's update within bf16 error of one rank's (5% in norm)."""
    out = tmp_path / "out.pt"
    start_processes(_tp_worker, args=(str(out), str(tmp_path / "rdv")), nprocs=2, join=True)
    two = torch.load(out, weights_only=False)
    init_distributed()
    before = dict(engine_for("float32").full_state_dict())
    one = _two_steps("bfloat16")["weights"]
    assert sorted(two) == sorted(one) and any(n.startswith("mtp.") for n in one)
    for name, ref in one.items():
        assert rel(two[name] - before[name], ref - before[name]) <= 0.05, name
