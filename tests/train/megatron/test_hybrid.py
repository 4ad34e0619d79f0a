"""Qwen3.5 / 3.6 hybrids (Gated DeltaNet + gated full attention) in the Megatron engine.

References: transformers' ``Qwen3_5ForCausalLM`` run on each sequence alone (packed logits); the
FSDP2 engine, which trains these models already (log-probs, PPO loss, stats, every gradient, the MTP
head's loss and gradients, weights after clipped optimizer steps); one process for two gloo ranks
as TP=2 or as two pipeline stages; the published checkpoint the engine was built from (export and
save names, the carried vision tower)."""

import copy

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.model.mtp import MTPConfig  # noqa: E402
from areal_npu.train.dist import init_distributed, process_group  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.megatron_tiny import full_logits, make_samples, megatron_config, ppo_step, tiny_qwen35  # noqa: E402

CAP = 24  # several micro-batches
OPTIM = dict(lr=1e-2, grad_clip=0.05, eps=1e-3)
MTP = MTPConfig(enabled=True, train=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)


def _megatron(lm, head=None, tp=1, pp=1, mtp=None, recompute=False):
    from areal_npu.train.megatron.config import MegatronLayoutConfig
    from areal_npu.train.megatron.engine import MegatronEngine

    cfg = megatron_config(packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(**OPTIM),
                          gradient_checkpointing=recompute)  # fmt: skip
    cfg.megatron = MegatronLayoutConfig(tp_size=tp, pp_size=pp)
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
    for a, b in zip(got["prox"], want["prox"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for key in ("ppo/loss", "train/grad_norm", "train/n_tokens"):
        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-5), key
    assert sorted(got["grads"]) == sorted(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=1e-6, msg=name)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_logits_equal_transformers_on_each_sequence():
    init_distributed()
    _, lm, _ = tiny_qwen35()
    engine = _megatron(lm)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (7, 12, 5)]
    for seq, got in zip(seqs, full_logits(engine, seqs), strict=True):
        with torch.no_grad():
            want = lm(input_ids=seq[None]).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ppo_step_and_mtp_head_equal_the_fsdp2_engine():
    init_distributed()
    _, lm, head = tiny_qwen35()
    got, want = _step(_megatron(lm, head, mtp=MTP)), _step(_fsdp(lm, head, mtp=MTP))
    assert got["stats"]["packing/micro_batches"] >= 2
    assert any(n.startswith("mtp.") for n in want["grads"]) and any("linear_attn" in n for n in want["grads"])
    for key in ("mtp/loss", "mtp/acc_d1"):
        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-5), key
    _assert_equal(got, want)


def test_recomputation_gives_the_same_gradients():
    """Megatron's full recomputation re-runs the Gated DeltaNet layers in backward: same gradients."""
    init_distributed()
    _, lm, _ = tiny_qwen35()
    plain = _step(_megatron(lm))
    engine = _megatron(lm, recompute=True)
    assert engine.module.config.recompute_granularity == "full"
    _assert_equal(_step(engine), plain, rtol=1e-6)


def _worker(rank, tp, pp, path, init_file):
    with process_group(rank, 2, f"file://{init_file}"):
        _, lm, _ = tiny_qwen35()
        torch.save(_step(_megatron(lm, tp=tp, pp=pp)), f"{path}.{rank}")


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_ranks_equal_one_process(tmp_path, tp, pp):
    mp.start_processes(_worker, args=(tp, pp, str(tmp_path / "out"), str(tmp_path / "rdv")), nprocs=2,
                       join=True, start_method="spawn")  # fmt: skip
    init_distributed()
    _, lm, _ = tiny_qwen35()
    one = _step(_megatron(lm))
    for rank in range(2):
        _assert_equal(torch.load(tmp_path / f"out.{rank}", weights_only=False), one)


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
    [(dict(cp_size=2), "cp_size=2"), (dict(tp_size=2, sequence_parallel=True), "sequence_parallel"),
     (dict(tp_size=4), "divisible by tp_size=4")],
)  # fmt: skip
def test_layouts_a_hybrid_cannot_run_are_refused(layout, fragment):
    from areal_npu.train.megatron.model import check_layout

    config, _, _ = tiny_qwen35(num_key_value_heads=2, num_attention_heads=4)
    with pytest.raises(ValueError, match=fragment):
        check_layout(config, layout.get("tp_size", 1), 1, layout.get("cp_size", 1), layout.get("sequence_parallel", False))
