"""An FSDP2 run that trains an EAGLE-3 drafter beside the policy resumes the drafter exactly, and the
engines of a resumed run start from the trained drafter, not a fresh one.

References: the saved engine itself (its drafter's fp32 parameters, AdamW ``exp_avg`` /
``exp_avg_sq`` / ``step`` and learning rates, full tensors read in the test) and the uninterrupted
run (the saved engine taking one more step) that the resumed engine's same step must equal bit for bit.
The resumed engine is built with a drafter from another seed, so only the load can make it equal."""

from __future__ import annotations

import pytest
import torch

from areal_npu import names
from areal_npu.data.packing import PackingConfig
from areal_npu.model.eagle3 import Eagle3Config, Eagle3Drafter, load_eagle3_drafter
from areal_npu.model.tiny import build_tiny_model
from areal_npu.train.checkpoint import latest_checkpoint
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import SFTLoss
from areal_npu.train.optim import OptimConfig
from tests.train.test_engine import TINY, make_samples

E3 = Eagle3Config(enabled=True, num_depths=2, lr_scale=2.0)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def _engine(seed: int) -> FSDPEngine:
    lm, _, _ = build_tiny_model(TINY)
    optim = OptimConfig(lr=1e-2, grad_clip=1.0, schedule="cosine", warmup_steps=1, total_steps=6)
    cfg = TrainEngineConfig(packing=PackingConfig(max_tokens_per_mb=24), optim=optim)
    drafter = Eagle3Drafter.for_policy(lm.config, E3, torch.Generator().manual_seed(seed))
    return FSDPEngine(lm, None, cfg, eagle3=drafter, eagle3_config=E3)


def _step(engine: FSDPEngine, seed: int) -> None:
    engine.forward_backward(make_samples(2, seed=seed), SFTLoss())
    engine.optimizer_step()


def _drafter_state(engine: FSDPEngine) -> dict:
    """Full tensors of the drafter's parameters and optimizer states, by name, plus the lr of each group."""
    out = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    for name, p in engine.module.named_parameters():
        if not name.startswith(names.EAGLE3_PREFIX):
            continue
        out["param"][name] = p.full_tensor().clone()
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[key][name] = value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
    out["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    return out


def _assert_equal(a: dict, b: dict) -> None:
    assert a["lr"] == b["lr"]
    for key in ("param", "exp_avg", "exp_avg_sq", "step"):
        assert a[key].keys() == b[key].keys() and a[key], key
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)


def test_a_checkpoint_resumes_the_drafter_and_its_optimizer_bit_for_bit(tmp_path):
    saved = _engine(seed=0)
    _step(saved, seed=1)
    saved.save_checkpoint(tmp_path / "ckpt", extra={"step": 0})
    before = _drafter_state(saved)

    resumed = _engine(seed=7)  # another drafter: only the load can make it equal
    fresh = _drafter_state(resumed)["param"]
    assert any(not torch.equal(fresh[n], t) for n, t in before["param"].items())
    assert resumed.load_checkpoint(latest_checkpoint(tmp_path / "ckpt")) == {"step": 0}
    _assert_equal(_drafter_state(resumed), before)
    assert resumed.version == saved.version

    # one more identical step: the resumed run equals the uninterrupted one, drafter and policy
    _step(saved, seed=2)
    _step(resumed, seed=2)
    after = _drafter_state(saved)
    _assert_equal(_drafter_state(resumed), after)
    assert any(not torch.equal(before["param"][n], t) for n, t in after["param"].items())  # it trained
    policy = {n: p.full_tensor() for n, p in saved.lm.named_parameters()}
    assert all(torch.equal(p.full_tensor(), policy[n]) for n, p in resumed.lm.named_parameters())


def test_a_resumed_runs_engines_start_from_the_trained_drafter(tmp_path):
    """``run.py``'s trainer set-up (``_trainer``): the drafter it writes for the engines
    (``rollout.spec.draft_model``) is the initial one on a fresh start and, on a resume, the one the
    checkpoint holds (the saved engine's), not a new initial one. No vLLM engine is started."""
    from areal_npu.config import load_config
    from areal_npu.model.eagle3 import initial_drafter
    from areal_npu.model.tiny import save_tiny_model
    from areal_npu.recipe import RLConfig
    from areal_npu.run import _trainer
    from tests.test_recipe_eagle3 import EAGLE3, QUICKSTART

    cfg = load_config(RLConfig, QUICKSTART, [*EAGLE3, f"run_dir={tmp_path / 'run'}"])
    out = cfg.rollout.spec.draft_model

    def named(drafter) -> dict:
        return {names.EAGLE3_PREFIX + n: p for n, p in drafter.named_parameters()}

    def written() -> dict:
        return named(load_eagle3_drafter(out))

    base = save_tiny_model(tmp_path / "base", cfg.model.tiny)
    first = named(initial_drafter(base, cfg.eagle3, cfg.seed))  # what the fresh start trains from
    engine, extra = _trainer(cfg, base, None, pad_token_id=0)
    assert extra is None
    got = written()
    assert got.keys() == first.keys() and all(torch.equal(got[n], first[n]) for n in first)

    _step(engine, seed=3)
    step_dir = engine.save_checkpoint(tmp_path / "ckpt", extra={"step": 0})
    trained = dict(engine.eagle3_state_dict())
    assert any(not torch.equal(trained[n], first[n]) for n in first)  # the step moved the drafter
    resumed, extra = _trainer(cfg, step_dir, step_dir, pad_token_id=0)
    assert extra == {"step": 0}
    got = written()  # the tiny policy declares float32: the file holds the fp32 masters as they are
    assert got.keys() == trained.keys() and all(torch.equal(got[n], trained[n]) for n in trained)
