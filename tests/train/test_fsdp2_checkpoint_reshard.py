"""An FSDP2 checkpoint saved by 2 gloo ranks resumes at 1, 2 and 4 ranks: the fp32 parameters,
both AdamW moments, the step counts, the learning rate, the version and the caller's state each
new layout holds equal the saved ones bit for bit. Reference, taken in the test only: every
parameter's and moment's full tensor (DTensor's own ``full_tensor``), before the save and after each
load. Shapes are chosen so the FSDP2 shards are uneven (51 rows over 2 and 4 ranks): the saved rows
of one rank straddle two ranks' shards at the new size. Each rank writes its own shard files."""

import pytest
import torch

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.distributed


def _engine():
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.model.tiny import TinyModelConfig, build_tiny_model
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.optim import OptimConfig

    tiny = TinyModelConfig(hidden_size=32, intermediate_size=51, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, layout="text", linear_attention_every=0,
                           mtp_num_hidden_layers=1, seed=5)  # fmt: skip
    lm, head, _ = build_tiny_model(tiny)
    optim = OptimConfig(lr=1e-2, eps=1e-3, schedule="cosine", warmup_steps=1, total_steps=6)
    cfg = TrainEngineConfig(optim=optim)
    cfg.packing.max_tokens_per_mb = 40
    return FSDPEngine(lm, head, cfg, mtp_config=MTPConfig(enabled=True, train=True))


def _by_hand(engine) -> dict:
    """Full tensors of the parameters and of each optimizer state, by parameter name."""
    out = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    for name, p in engine.module.named_parameters():
        out["param"][name] = p.full_tensor().clone()
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[key][name] = value.full_tensor().clone() if key != "step" else value.clone()
    out["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    out["version"] = engine.version
    return out


def _worker(rank, world, init_file, out_dir, phase):
    from pathlib import Path

    from areal_npu.train.checkpoint import latest_checkpoint
    from areal_npu.train.dist import process_group
    from tests.support.megatron_tiny import make_samples, ppo_step

    out_dir = Path(out_dir)
    with process_group(rank, world, f"file://{init_file}"):
        engine = _engine()
        if phase == "save":
            ppo_step(engine, make_samples(3, seed=rank), lambda e: None)  # each rank its own share
            engine.save_checkpoint(out_dir / "ckpt", extra={"data_position": 7})
            extra = {"data_position": 7}
        else:
            before = _by_hand(engine)["param"]
            extra = engine.load_checkpoint(latest_checkpoint(out_dir / "ckpt"))
        state = _by_hand(engine)
        state["extra"] = extra
        if phase != "save":
            state["moved"] = sum(not torch.equal(before[n], t) for n, t in state["param"].items())
        if rank == 0:
            torch.save(state, out_dir / f"{phase}.pt")


def _spawn(phase, world, out_dir):
    codes = run_ranks(_worker, (world, str(out_dir / f"{phase}.rdv"), str(out_dir), phase), world)
    assert codes == [0] * world, f"{phase} ranks failed: {codes}"
    return torch.load(out_dir / f"{phase}.pt", weights_only=False)


def test_a_two_rank_checkpoint_resumes_at_one_two_and_four_ranks_bit_for_bit(tmp_path):
    saved = _spawn("save", 2, tmp_path)
    step = tmp_path / "ckpt" / "step_1"
    for state in ("master", "exp_avg", "exp_avg_sq"):  # each rank wrote its own shards
        files = sorted(p.name for p in (step / "optim" / state).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], (state, files)
    assert saved["version"] == 1 and {float(s) for s in saved["step"].values()} == {1.0}
    assert any(n.startswith("mtp.") for n in saved["exp_avg"])
    assert sorted(saved["exp_avg"]) == sorted(saved["param"])  # every parameter trained
    for phase, world in (("dp1", 1), ("dp2", 2), ("dp4", 4)):
        loaded = _spawn(phase, world, tmp_path)
        assert loaded["moved"] > 0, phase  # the fresh engine's weights were not the saved ones
        for key in ("version", "lr", "extra"):
            assert loaded[key] == saved[key], (phase, key)
        for key in ("param", "exp_avg", "exp_avg_sq", "step"):
            assert sorted(loaded[key]) == sorted(saved[key]), (phase, key)
            for name, tensor in saved[key].items():
                assert key == "step" or tensor.abs().sum() > 0, (key, name)  # real state, not zeros
                msg = f"{phase} {key} {name}"
                torch.testing.assert_close(loaded[key][name], tensor, rtol=0, atol=0, msg=msg)
