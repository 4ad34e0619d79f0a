"""Resuming a multi-rank Megatron run: two spawned gloo ranks (TP=2, PP=2 or DP=2) take a PPO step, save,
take a second one; NEW processes build engines, load the checkpoint and take the second step again.

Reference: the uninterrupted run's second step (stats, learning rate, every weight under HF names,
each rank's torch RNG draw right after the save / the load), same layout, same data. The saved
weights are a Hugging Face checkpoint transformers loads, equal to the engine's ``full_state_dict``
whatever the TP or pipeline layout. At PP=2 the engine trains the MTP head too (on the last stage;
its weights, written by rank 0 of the first, and its AdamW state resume with the rest). The PP=2
checkpoint resumes at PP=1: the masters, AdamW moments and step count the one-stage engine holds
equal both stages' at the save, bit for bit (reference: ``optimizer_state_by_hand`` on each stage,
global layer names), and its MTP head's step count and weights are the saved ones.
(One rank: ``test_checkpoint.py``.)
"""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from areal_npu import names  # noqa: E402
from areal_npu.platform import current_platform  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402

LAYOUTS = {"tp2": (2, 1, 1), "dp2": (1, 2, 1), "pp2": (1, 1, 2)}  # (tp, dp, pp) on 2 ranks


def _engine(tp: int, pp: int = 1, mtp: bool = False):
    from areal_npu.data.packing import PackingConfig
    from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights
    from areal_npu.train.megatron.engine import MegatronEngine
    from areal_npu.train.optim import OptimConfig
    from tests.support.megatron_tiny import megatron_config, tiny_qwen3

    config, hf = tiny_qwen3()
    # a schedule that moves the lr every step, two optimizer steps per train_step; Adam's eps
    # well above rounding noise (as test_multirank_megatron.py)
    optim = OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-3, schedule="cosine", warmup_steps=1, total_steps=6)
    cfg = megatron_config(tp, ppo_minibatches=2, packing=PackingConfig(max_tokens_per_mb=40), optim=optim)
    cfg.megatron.pp_size = pp
    if not mtp:
        return MegatronEngine.from_hf_model(hf, cfg)
    head = Qwen35MTP(config, 1)
    init_mtp_weights(head, std=0.08, generator=torch.Generator().manual_seed(11))
    mtp_config = MTPConfig(enabled=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)
    return MegatronEngine.from_hf_model(hf, cfg, mtp=head, mtp_config=mtp_config)


def _step(engine, seed: int, dp_rank: int, dp: int) -> dict:
    from areal_npu.train.losses import PPOLoss
    from tests.support.megatron_tiny import make_samples

    samples = make_samples(8, seed=seed)[dp_rank::dp]  # this data rank's share; TP peers the same
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        s.prox_logp = lp
    return engine.train_step(samples, PPOLoss())


def _worker(rank, world, init_file, out_dir, phase, layout):
    from pathlib import Path

    from areal_npu.train.dist import process_group
    from tests.support.megatron_tiny import optimizer_state_by_hand

    tp, dp, pp = LAYOUTS[layout]
    out_dir, dp_rank = Path(out_dir), (rank // tp) % dp  # Megatron's rank order: tp, (cp), dp, pp
    with process_group(rank, world, f"file://{init_file}"):
        engine = _engine(tp, pp, mtp=layout == "pp2")
        if phase == "run":
            _step(engine, 0, dp_rank, dp)
            saved = engine.save_checkpoint(out_dir / "ckpt", extra={"data_position": 8})
            if layout == "pp2":  # each stage's optimizer state, for the resume at PP=1
                torch.save(optimizer_state_by_hand(engine), out_dir / f"stage{rank}.pt")
            weights1 = dict(engine.full_state_dict())  # collective: every rank iterates
            extra = None
        else:
            saved = out_dir / "ckpt" / "step_1"
            extra = engine.load_checkpoint(saved)
            weights1 = None
        draw = torch.rand(4)  # the RNG state at the save == the one restored by the load
        version = engine.version
        stats = _step(engine, 1, dp_rank, dp)
        weights2 = dict(engine.full_state_dict())
        torch.save({"draw": draw}, out_dir / f"{phase}_rng{rank}.pt")
        if rank == 0:
            out = {"saved": str(saved), "extra": extra, "version": version, "weights1": weights1}
            torch.save(dict(out, stats=stats, weights2=weights2), out_dir / f"{phase}.pt")


def _spawn(phase, layout, out_dir, timeout_s=300):
    """``_worker`` on 2 spawned ranks; a rank left waiting fails the test instead of hanging it."""
    args = (2, str(out_dir / f"{phase}.rdv"), str(out_dir), phase, layout)
    assert run_ranks(_worker, args, 2, timeout_s) == [0, 0], f"{phase} ranks failed"
    return torch.load(out_dir / f"{phase}.pt", weights_only=False)


def _assert_close_rel(a: float, b: float, key: str):
    assert a == pytest.approx(b, rel=1e-6, abs=1e-9), (key, a, b)


@pytest.mark.skipif(
    current_platform().device_type != "cpu" and current_platform().device_count() < 2,
    reason="two ranks need two accelerators on this machine",
)
@pytest.mark.parametrize("layout", ["tp2", "pp2", pytest.param("dp2", marks=pytest.mark.slow)])
def test_a_resumed_two_rank_run_continues_exactly(tmp_path, layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = _spawn("run", layout, tmp_path)
    resumed = _spawn("resume", layout, tmp_path)  # new processes, the checkpoint of step 1

    saved = tmp_path / "ckpt" / "step_1"
    assert run["saved"] == str(saved) and resumed["extra"] == {"data_position": 8}
    assert run["version"] == resumed["version"] == 1
    tp = LAYOUTS[layout][0]
    index = torch.load(saved / "optim.pt", weights_only=False)  # the layout; the state in optim/
    assert index["tp_size"] == tp and index["format"] == "optim"
    assert sorted(p.name for p in (saved / "optim" / "master").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    a, b = run["stats"], resumed["stats"]
    assert set(a) == set(b) and {
        names.PPO_LOSS,
        names.TRAIN_GRAD_NORM,
        names.TRAIN_LR,
        names.TRAIN_N_TOKENS,
    } <= set(a)
    assert (names.MTP_LOSS in a) is (layout == "pp2")
    for key in a:
        _assert_close_rel(b[key], a[key], key)
    assert a[names.TRAIN_VERSION] == 2.0
    assert sorted(resumed["weights2"]) == sorted(run["weights2"])
    for name, tensor in run["weights2"].items():
        torch.testing.assert_close(resumed["weights2"][name], tensor, rtol=1e-6, atol=1e-8, msg=name)
        assert not torch.equal(tensor, run["weights1"][name]), f"{name} did not move in step 2"
    for rank in range(2):
        drawn = [torch.load(tmp_path / f"{p}_rng{rank}.pt")["draw"] for p in ("run", "resume")]
        torch.testing.assert_close(drawn[1], drawn[0], rtol=0, atol=0)

    # the weights are a Hugging Face checkpoint of the full (TP-gathered) tensors
    on_disk = load_file(str(saved / "model.safetensors"))
    assert sorted(on_disk) == sorted(run["weights1"])
    for name, tensor in run["weights1"].items():
        assert torch.equal(on_disk[name], tensor), name
    hf = AutoModelForCausalLM.from_pretrained(saved)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, run["weights1"][name]), name

    if layout == "pp2":  # resumed at PP=1 (another TP x DP layout: test_checkpoint_reshard.py)
        from areal_npu.train.dist import init_distributed
        from tests.support.megatron_tiny import optimizer_state_by_hand

        init_distributed()
        one = _engine(1, mtp=True)
        assert one.load_checkpoint(saved) == {"data_position": 8} and one.version == 1
        head = one.optimizer.groups[1]  # the MTP head's state, written by the last stage's ranks
        assert float(one.optimizer.optimizer.state[head.master]["step"]) == 2.0
        for name, tensor in one.full_state_dict():
            if name.startswith("mtp."):
                torch.testing.assert_close(tensor, run["weights1"][name], rtol=0, atol=0, msg=name)
        got = optimizer_state_by_hand(one)
        stages = [torch.load(tmp_path / f"stage{rank}.pt", weights_only=False) for rank in range(2)]
        assert got["step"] == stages[0]["step"] == stages[1]["step"] == 2.0
        for state in ("master", "exp_avg", "exp_avg_sq"):
            first, second = stages[0][state], stages[1][state]
            assert not set(first) & set(second) and sorted(got[state]) == sorted({**first, **second})
            expected = {**first, **second}
            for name, tensor in expected.items():
                assert tensor.abs().sum() > 0, (state, name)
                torch.testing.assert_close(got[state][name], tensor, rtol=0, atol=0, msg=f"{state} {name}")
