"""Megatron engine checkpoints: a resumed run continues exactly; the weights are an HF checkpoint."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu import names  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.train.checkpoint import checkpoint_to_resume, latest_checkpoint  # noqa: E402
from areal_npu.train.dist import init_distributed  # noqa: E402
from areal_npu.train.losses import PPOLoss  # noqa: E402
from areal_npu.train.manifest import checkpoint_problems  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def _engine():
    from areal_npu.train.megatron.engine import MegatronEngine

    _, hf = tiny_qwen3()
    cfg = megatron_config(
        packing=PackingConfig(max_tokens_per_mb=24),
        optim=OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=1, total_steps=5),
    )
    return MegatronEngine.from_hf_model(hf, cfg)


def _step(engine, seed):
    samples = make_samples(seed=seed)
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    return engine.train_step(samples, PPOLoss())


def test_resume_continues_exactly_and_weights_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    a = _engine()
    _step(a, 0)
    saved = a.save_checkpoint(tmp_path / "ckpt", extra={"data_position": 5})
    assert latest_checkpoint(tmp_path / "ckpt") == saved and not checkpoint_problems(saved)
    assert checkpoint_to_resume(tmp_path / "ckpt", warn=pytest.fail) == saved
    expected = _step(a, 1)
    b = _engine()
    assert b.load_checkpoint(saved) == {"data_position": 5} and b.version == 1
    got = _step(b, 1)
    assert got[names.PPO_LOSS] == pytest.approx(expected[names.PPO_LOSS], rel=1e-6)
    assert got[names.TRAIN_LR] == pytest.approx(expected[names.TRAIN_LR], rel=1e-12)
    wa, wb = dict(a.full_state_dict()), dict(b.full_state_dict())
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-6, atol=1e-7, msg=name)
    hf = AutoModelForCausalLM.from_pretrained(saved)  # what vLLM / transformers load
    assert type(hf).__name__ == "Qwen3ForCausalLM"


def test_resume_from_an_old_format_is_refused(tmp_path):
    """Another TP x DP or pipeline layout reshards (test_checkpoint_reshard.py, test_checkpoint_parallel.py);
    the per-rank optimizer files of older versions are refused, naming why."""
    a = _engine()
    saved = a.save_checkpoint(tmp_path / "ckpt")
    torch.save({"tp_size": 1, "shards": [["optim_tp0_dp0.pt"]]}, saved / "optim.pt")  # before optim/
    with pytest.raises(ValueError, match="older areal-npu"):
        _engine().load_checkpoint(saved)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_optimizer_shard_is_detected_and_the_previous_checkpoint_resumed(tmp_path, damage):
    """The manifest (each rank's own files: size and CRC-32) catches a shorter shard and one flipped
    byte in a same-size shard; ``--resume`` falls back to step_1 naming the file."""
    import zlib

    a = _engine()
    _step(a, 0)
    first = a.save_checkpoint(tmp_path / "ckpt")
    _step(a, 1)
    second = a.save_checkpoint(tmp_path / "ckpt")
    shard = second / "optim" / "exp_avg" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    listed = __import__("json").loads((second / "manifest.json").read_text())["files"][
        "optim/exp_avg/__0_0.distcp"
    ]
    assert listed == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}  # independent: zlib here
    if damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 3] ^= 0x01
        shard.write_bytes(bytes(data))
    warnings = []
    assert (
        checkpoint_problems(first) == [] and checkpoint_to_resume(tmp_path / "ckpt", warnings.append) == first
    )
    assert len(warnings) == 1 and str(shard) in warnings[0], warnings
