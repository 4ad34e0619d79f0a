"""Qwen3.5 / 3.6 hybrids (Gated DeltaNet + gated full attention) in the Megatron engine.

References: transformers' ``Qwen3_5ForCausalLM`` run on each sequence alone (packed logits); the
FSDP2 engine, which trains these models already (log-probs, PPO loss, stats, every gradient, the MTP
head's loss and gradients, weights after clipped optimizer steps); one process for two gloo ranks
as TP=2 (also with sequence parallelism and MTP), as two pipeline stages or as CP=2 with MTP; the published checkpoint the engine was built from (export and
save names, the carried vision tower)."""

import copy

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu import names  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.model.mtp import MTPConfig  # noqa: E402
from areal_npu.train.dist import init_distributed, process_group  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import approx, tolerance  # noqa: E402
from tests.support.megatron_tiny import (  # noqa: E402
    full_logits,
    make_samples,
    megatron_config,
    ppo_step,
    ranks_fit,
    tiny_qwen35,
)
from tests.support.ranks import start_processes  # noqa: E402

CAP = 24  # several micro-batches
OPTIM = dict(lr=1e-2, grad_clip=0.05, eps=1e-3)
MTP = MTPConfig(enabled=True, train=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)
FOUR_LINEAR_KEY_HEADS = dict(num_key_value_heads=4)  # the Gated DeltaNet's heads split over TP x CP = 4


def _megatron(lm, head=None, tp=1, pp=1, mtp=None, recompute=False, cp=1, sp=False):
    from areal_npu.train.config import MegatronLayoutConfig
    from areal_npu.train.megatron.engine import MegatronEngine

    cfg = megatron_config(packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(**OPTIM),
                          gradient_checkpointing=recompute)  # fmt: skip
    cfg.megatron = MegatronLayoutConfig(tp_size=tp, pp_size=pp, cp_size=cp, sequence_parallel=sp)
    cfg.validate()
    return MegatronEngine.from_hf_model(lm, cfg, head, mtp_config=copy.deepcopy(mtp))


def _fsdp(lm, head=None, mtp=None):
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine

    cfg = TrainEngineConfig(packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(**OPTIM))
    return FSDPEngine(copy.deepcopy(lm), copy.deepcopy(head), cfg, mtp_config=copy.deepcopy(mtp))


def _step(engine, seed=0):
    grads = None if hasattr(engine, "hf_grads") else _fsdp_grads
    prox, stats, grads = ppo_step(engine, make_samples(6, seed=seed), grads)
    return {"prox": prox, "stats": stats, "grads": grads, "weights": dict(engine.full_state_dict())}


def _fsdp_grads(engine):
    out = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name[len("lm.") :] if name.startswith("lm.") else name] = grad.detach().clone()
    return out


def _assert_equal(got, want, rtol=1e-4):
    """``rtol``: the gradients' on the CPU; accelerators: :mod:`tests.support.device`."""
    for a, b in zip(got["prox"], want["prox"], strict=True):
        torch.testing.assert_close(a, b, **tolerance("values", dict(rtol=1e-5, atol=1e-5), b))
    for key in (names.PPO_LOSS, names.TRAIN_GRAD_NORM, names.TRAIN_N_TOKENS):
        assert got["stats"][key] == pytest.approx(
            want["stats"][key], **approx("values", 1e-5, want["stats"][key])
        ), key
    assert sorted(got["grads"]) == sorted(want["grads"])
    for name, grad in want["grads"].items():
        tol = tolerance("grads", dict(rtol=rtol, atol=1e-6), grad)
        torch.testing.assert_close(got["grads"][name], grad, **tol, msg=name)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, tensor in want["weights"].items():
        tol = tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor)
        torch.testing.assert_close(got["weights"][name], tensor, **tol, msg=name)


def test_packed_logits_equal_transformers_on_each_sequence():
    init_distributed()
    _, lm, _ = tiny_qwen35()
    engine = _megatron(lm)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (7, 12, 5)]
    for seq, got in zip(seqs, full_logits(engine, seqs), strict=True):
        with torch.no_grad():
            want = lm(input_ids=seq[None]).logits[0]
        torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))


def test_ppo_step_and_mtp_head_equal_the_fsdp2_engine():
    init_distributed()
    _, lm, head = tiny_qwen35()
    got, want = _step(_megatron(lm, head, mtp=MTP)), _step(_fsdp(lm, head, mtp=MTP))
    assert got["stats"][names.PACKING_MICRO_BATCHES] >= 2
    assert any(n.startswith("mtp.") for n in want["grads"]) and any("linear_attn" in n for n in want["grads"])
    for key in (names.MTP_LOSS, names.mtp_acc_key(1)):
        assert got["stats"][key] == pytest.approx(
            want["stats"][key], **approx("values", 1e-5, want["stats"][key])
        ), key
    _assert_equal(got, want)


def test_recomputation_gives_the_same_gradients():
    """Megatron's full recomputation re-runs the Gated DeltaNet layers in backward: same gradients."""
    init_distributed()
    _, lm, _ = tiny_qwen35()
    plain = _step(_megatron(lm))
    engine = _megatron(lm, recompute=True)
    assert engine.module.config.recompute_granularity == "full"
    _assert_equal(_step(engine), plain, rtol=1e-6)


def _worker(rank, layout, mtp, path, init_file):
    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1)
    with process_group(rank, world, f"file://{init_file}"):
        _, lm, head = tiny_qwen35(**layout.pop("model", {}))
        torch.save(_step(_megatron(lm, head if mtp else None, mtp=mtp, **layout)), f"{path}.{rank}")


@pytest.mark.distributed
@pytest.mark.skipif(not ranks_fit(2), reason="two ranks need two accelerators on this machine")
@pytest.mark.parametrize(
    "layout, mtp",
    [(dict(tp=2), None), (dict(pp=2), None), (dict(tp=2, sp=True), MTP), (dict(cp=2), MTP),
     pytest.param(dict(tp=2, cp=2, sp=True, recompute=True, model=FOUR_LINEAR_KEY_HEADS), MTP,
                  marks=pytest.mark.skipif(not ranks_fit(4), reason="4 devices"))],
    ids=["tp2", "pp2", "tp2-sp-mtp", "cp2-mtp", "tp2-cp2-sp-recompute-mtp"],
)  # fmt: skip
def test_parallel_ranks_equal_one_process(tmp_path, layout, mtp):
    """Sequence and context parallelism hand the Gated DeltaNet layers a share of each row (they
    gather it); with CP the MTP head's targets are cut from the whole row. The last case is the 64K
    recipe's kind of layout (TP x CP, sequence parallel, recomputation, MTP) on 4 ranks."""
    model = layout.get("model", {})
    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1)
    start_processes(_worker, args=(layout, mtp, str(tmp_path / "out"), str(tmp_path / "rdv")), nprocs=world,
                       join=True)  # fmt: skip
    init_distributed()
    _, lm, head = tiny_qwen35(**model)
    one = _step(_megatron(lm, head if mtp else None, mtp=mtp))
    for rank in range(world):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        if mtp:
            for key in (names.MTP_LOSS, names.mtp_acc_key(1), names.mtp_count_key(1)):
                assert got["stats"][key] == pytest.approx(
                    one["stats"][key], **approx("values", 1e-5, one["stats"][key])
                ), key
        _assert_equal(got, one)


def test_a_published_checkpoint_exports_and_saves_in_its_layout(tmp_path):
    from safetensors.torch import load_file

    from areal_npu.model.tiny import TinyModelConfig, save_tiny_model
    from areal_npu.train.factory import build_engine

    init_distributed()
    src = save_tiny_model(tmp_path / "src", TinyModelConfig(**{"layout": "published", "linear_head_dim": 0,
                                                                "hidden_size": 64, "head_dim": 16}))  # fmt: skip
    engine = build_engine(megatron_config(), src, MTPConfig(enabled=True, train=True), pad_token_id=0)
    on_disk = load_file(str(src / "model.safetensors"))
    exported = {n: t for kind in ("policy", "mtp", "vision")
                for _, bucket in engine.export_buckets(kinds=(kind,)) for n, t in bucket}  # fmt: skip
    assert sorted(exported) == sorted(on_disk)  # every name of the published layout, vision included
    for name, tensor in on_disk.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert not [n for _, b in engine.export_buckets() for n, _ in b if n.startswith("model.visual.")]
    out = engine.save_hf_checkpoint(tmp_path / "saved")
    saved = load_file(str(out / "model.safetensors"))
    assert sorted(saved) == sorted(on_disk)
    for name, tensor in on_disk.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-6, msg=name)
    config = (out / "config.json").read_text()
    assert "Qwen3_5ForConditionalGeneration" in config and "vision_config" in config


@pytest.mark.parametrize(
    "layout, fragment",
    [(dict(tp_size=4), "divisible by tp_size=4"), (dict(tp_size=2, cp_size=2), "tp_size=2 x cp_size=2")],
)  # fmt: skip
def test_layouts_a_hybrid_cannot_run_are_refused(layout, fragment):
    """The tiny hybrid's 2 linear key heads split over 2 ranks, not 4 (TP x CP)."""
    from areal_npu.train.megatron.model import check_layout

    config, _, _ = tiny_qwen35(num_key_value_heads=2, num_attention_heads=4)
    with pytest.raises(ValueError, match=fragment):
        check_layout(
            config,
            layout.get("tp_size", 1),
            1,
            layout.get("cp_size", 1),
            layout.get("sequence_parallel", False),
        )
