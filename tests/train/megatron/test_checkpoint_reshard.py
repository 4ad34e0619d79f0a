"""A Megatron checkpoint saved at TP=2 (2 gloo ranks, one pipeline stage) resumes at TP=1 (1 rank),
at TP=2 x DP=2 (4 ranks) and at TP=1 x PP=2 (2 ranks, a stage each): the fp32 masters, both AdamW
moments and the step counts each new layout holds equal the saved ones. Reference, built by hand in
the test only (``optimizer_state_by_hand``): every rank's fp32 flat buffers all-gathered over DP x CP,
unflattened and un-sharded over TP into full tensors under HF names (global layer indices; at PP=2
the two stages' disjoint halves joined), before the save and after each load. (PP=2 -> PP=1:
test_checkpoint_parallel.py.)"""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from tests.support.ranks import run_ranks  # noqa: E402


def _worker(rank, world, init_file, out_dir, phase, tp, pp):
    from pathlib import Path

    from areal_npu.data.packing import PackingConfig
    from areal_npu.train.dist import process_group
    from areal_npu.train.losses import PPOLoss
    from areal_npu.train.megatron.engine import MegatronEngine
    from areal_npu.train.optim import OptimConfig
    from tests.support.megatron_tiny import make_samples, megatron_config, optimizer_state_by_hand, tiny_qwen3

    out_dir = Path(out_dir)
    with process_group(rank, world, f"file://{init_file}"):
        _, hf = tiny_qwen3()
        optim = OptimConfig(lr=1e-2, eps=1e-3, schedule="cosine", warmup_steps=1, total_steps=6)
        cfg = megatron_config(tp, ppo_minibatches=2, packing=PackingConfig(max_tokens_per_mb=40), optim=optim)
        cfg.megatron.pp_size = pp
        engine = MegatronEngine.from_hf_model(hf, cfg)
        if phase == "save":
            samples = make_samples(8, seed=0)
            for s, lp in zip(samples, engine.compute_logprobs(samples)):
                s.prox_logp = lp
            engine.train_step(samples, PPOLoss())
            engine.save_checkpoint(out_dir / "ckpt")
        else:
            engine.load_checkpoint(out_dir / "ckpt" / "step_1")
        state = optimizer_state_by_hand(engine)
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        masters = engine.optimizer.groups[0].unflatten(
            engine.optimizer._gather(engine.optimizer.groups[0].master.detach())
        )
        if rank % (world // pp) == 0:  # the first rank of each pipeline stage (rank order tp, dp, pp)
            state["params_match_masters"] = all(
                torch.equal(params[n], masters[n].to(params[n])) for n in params
            )
            torch.save(state, out_dir / f"{phase}_stage{rank // (world // pp)}.pt")


def _spawn(phase, tp, world, out_dir, pp=1):
    """The state the ranks hold, the pipeline stages' joined (each holds its own layers)."""
    codes = run_ranks(_worker, (world, str(out_dir / f"{phase}.rdv"), str(out_dir), phase, tp, pp), world)
    assert codes == [0] * world, f"{phase} ranks failed: {codes}"
    stages = [torch.load(out_dir / f"{phase}_stage{i}.pt", weights_only=False) for i in range(pp)]
    joined = {
        "step": stages[0]["step"],
        "params_match_masters": all(s["params_match_masters"] for s in stages),
    }
    assert all(s["step"] == joined["step"] for s in stages), phase
    for state in ("master", "exp_avg", "exp_avg_sq"):
        joined[state] = {}
        for stage in stages:
            assert not set(joined[state]) & set(stage[state]), (phase, state)  # disjoint layers
            joined[state].update(stage[state])
    return joined


def test_a_tp2_checkpoint_resumes_at_tp1_at_tp2_dp2_and_at_pp2(tmp_path):
    saved = _spawn("save", 2, 2, tmp_path)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step_1" / "optim" / "master").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # one file per rank
    assert saved["step"] == 2.0 and saved["params_match_masters"]
    for phase, tp, world, pp in (("tp1", 1, 1, 1), ("tp2dp2", 2, 4, 1), ("tp1pp2", 1, 2, 2)):
        loaded = _spawn(phase, tp, world, tmp_path, pp)
        assert loaded["step"] == saved["step"] and loaded["params_match_masters"], phase
        for state in ("master", "exp_avg", "exp_avg_sq"):
            assert sorted(loaded[state]) == sorted(saved[state])
            for name, tensor in saved[state].items():
                assert tensor.abs().sum() > 0, (state, name)  # a real state, not zeros on both sides
                torch.testing.assert_close(
                    loaded[state][name], tensor, rtol=0, atol=0, msg=f"{phase} {state} {name}"
                )
