"""The dry run's memory budget and step time against hand formulas, and ``train --dry-run`` as a
user runs it on the 64K recipe: a summary first, one row per role, the refusal above
``train.max_memory_fraction`` (exit 2, naming layouts that fit), node 0's address in header and rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_npu import cli
from areal_npu.memory_budget import HCCL_BUFFER_BYTES, RUNTIME_RESERVE_BYTES, device_budget
from areal_npu.memory_model import ModelDims, ParallelLayout, estimate_step_memory
from areal_npu.step_cost import PUBLISHED_RUN, scaled, step_time

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "code_agent_64k"
MODEL_JSON = RECIPES / "qwen3_6_27b_config.json"
GIB = 2**30
MIB = 2**20
DIMS = ModelDims.from_hf_config(json.loads(MODEL_JSON.read_text()))
T, H, V = 65536, 5120, 248320  # the recipe's micro-batch, the shipped hidden size and vocabulary


def _estimate(layout, **kw):
    kw = {"compute_dtype": "bfloat16", "gradient_checkpointing": True, "mtp_depths": 1, **kw}
    return estimate_step_memory(DIMS, T, layout, **kw)


# ---- memory terms ----


def test_gdn_sequence_parallel_gather_is_two_rows_with_checkpointing_and_all_inputs_without():
    lay = ParallelLayout(dp=2, tp=8, backend="megatron")
    row = 2 * T * H  # bf16 [T, h]: the gathered input row
    with_sp = _estimate(lay, sequence_parallel=True).items
    assert with_sp["Gated DeltaNet sequence-parallel gather"] == 2 * row
    assert "Gated DeltaNet sequence-parallel gather" not in _estimate(lay).items  # no SP, no cp: no gather
    n_linear = DIMS.layer_types.count("linear_attention")
    no_ckpt = _estimate(lay, sequence_parallel=True, gradient_checkpointing=False).items
    assert no_ckpt["Gated DeltaNet sequence-parallel gather"] == pytest.approx(
        n_linear * row * (1 - 1 / 8) + row
    )


def test_megatron_distributed_optimizer_shards_over_dp_and_cp():
    params = DIMS.num_parameters(with_mtp=True)
    items = _estimate(ParallelLayout(dp=2, tp=4, cp=2, backend="megatron")).items
    assert items["parameters (fp32 master)"] == pytest.approx(4 * params / (2 * 2 * 4))
    assert items["optimizer states (AdamW, 2 x fp32)"] == pytest.approx(8 * params / (2 * 2 * 4))
    assert items["gradients (fp32)"] == pytest.approx(4 * params / 4)  # not sharded over dp x cp


def test_budget_phases_reserve_and_fraction_by_hand():
    lay = ParallelLayout(dp=2, tp=8, backend="megatron")
    est = _estimate(lay, sequence_parallel=True)
    b = device_budget(est, DIMS, device_kind="npu", device_bytes=64 * GIB, max_fraction=0.85,
                      weight_bucket_bytes=256 * MIB, collective_transport=True)  # fmt: skip
    params = DIMS.num_parameters(with_mtp=True)
    steady = (
        4 * params / 16 + 4 * params / 8 + 8 * params / 16 + 2 * params / 8
    )  # masters, grads, states, bf16
    # the masters are written where they lie (no DP gather); the export gathers one bf16 tensor
    assert b.phases["checkpoint"] == pytest.approx(steady + 2 * 2 * V * H)
    assert b.phases["weight sync"] == pytest.approx(steady + 2 * 2 * V * H + 256 * MIB)
    assert b.phases["forward/backward"] == est.forward_backward_phase
    # communicators of trainer rank 0: world, tp, dp, the weight-sync group; in + out buffers each
    assert b.reserve == {"runtime context and workspaces": 2 * GIB, "HCCL buffers": 4 * 2 * 200 * MIB}
    assert RUNTIME_RESERVE_BYTES == 2 * GIB and HCCL_BUFFER_BYTES == 200 * MIB
    peak = max(b.phases.values())
    assert b.total == pytest.approx(1.05 * peak + 2 * GIB + 1600 * MIB)
    assert b.fraction == pytest.approx(b.total / (64 * GIB)) and b.fits is (b.fraction <= 0.85)
    cpu = device_budget(est, DIMS, device_kind="cpu", device_bytes=None, max_fraction=0.85,
                        weight_bucket_bytes=256 * MIB, collective_transport=False)  # fmt: skip
    assert (
        "HCCL buffers" not in cpu.reserve
        and cpu.fits is None
        and cpu.extra["weight sync"]["transport bucket"] == 0
    )


# ---- step time ----


def test_the_published_configuration_reproduces_the_published_times():
    run = PUBLISHED_RUN
    t = step_time(run.config, run.costs())
    assert (t.t_gen, t.t_train, t.t_sync) == pytest.approx((2000.0, 1300.0, 25.0), rel=1e-12)
    assert t.t_step == pytest.approx(3325.0) and t.t_gen_ar == pytest.approx(2000 * 100 / 56.6)
    assert run.config.weight_bytes == 2 * DIMS.num_parameters(
        with_mtp=True
    )  # the shipped config's bf16 weights


def test_data_parallel_part_is_inverse_in_the_nodes_and_sync_is_not():
    costs, base = PUBLISHED_RUN.costs(), PUBLISHED_RUN.config
    t1 = step_time(base, costs)
    for k in (2, 4):
        tk = step_time(scaled(base, dp=base.dp * k, engines=base.engines * k), costs)
        assert (tk.t_train, tk.t_gen, tk.t_sync) == pytest.approx((t1.t_train / k, t1.t_gen / k, t1.t_sync))


def test_train_time_is_the_1f1b_formula_and_speculation_divides_rollout():
    costs, base = PUBLISHED_RUN.costs(), PUBLISHED_RUN.config
    c = 1300.0 * 16 / (16 * T)  # device-seconds per token: 16 micro-batches of T tokens on tp 8 x cp 2 in 1300 s
    assert costs.train_s_per_token == pytest.approx(c)
    pp2 = step_time(scaled(base, cp=1, pp=2), costs)  # same 32 devices: 16 micro-batches, 2 stages
    assert pp2.t_train == pytest.approx((16 + 2 - 1) * T * c / (8 * 2))
    off = step_time(scaled(base, spec_k=0), costs)
    assert off.t_gen == pytest.approx(2000 * 100 / 56.6) and off.gen_speedup == 1
    capped = step_time(scaled(base, engines=16, in_flight=8), costs)  # 8 episodes in flight: 8 engines work
    assert capped.t_gen_ar == pytest.approx(off.t_gen_ar) and any("idle" in n for n in capped.notes)


# ---- the command ----


def _dry_run(capsys, monkeypatch, *args):
    monkeypatch.setenv("MODEL_PATH", "/nonexistent/Qwen3.6-27B")
    monkeypatch.setenv("TASKS", "")
    argv = ["train", str(RECIPES / "qwen3_6_27b_a3.yaml"), "--dry-run", "--devices-per-node", "16",
            "--model-config", str(MODEL_JSON), "--launcher", "ray", *args]  # fmt: skip
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


TWO_NODES = ("--nodes", "2", "train.dp_size=2", "train.megatron.cp_size=1", "rollout.num_engines=4")
FOUR_NODES = ("--nodes", "4", "train.dp_size=2", "rollout.num_engines=8")  # the recipe's cp 2


def test_refused_above_the_fraction_with_exit_2_and_layouts_that_fit(capsys, monkeypatch):
    code, out, err = _dry_run(capsys, monkeypatch, *TWO_NODES, "--json")
    data = json.loads(out)
    budget = data["estimates"]["memory"]["budget"]
    assert budget["fraction"] > 0.85 and budget["fits"] is False
    assert code == 2 and "refused" in err and "train.max_memory_fraction=0.85" in err
    assert "train.megatron.cp_size=2" in err  # a layout that fits, by name (4 nodes at cp 2)
    code, out, err = _dry_run(capsys, monkeypatch, *FOUR_NODES, "--json")
    fraction = json.loads(out)["estimates"]["memory"]["budget"]["fraction"]
    assert code == 0 and fraction <= 0.85 and "refused" not in err
    code, _, err = _dry_run(
        capsys, monkeypatch, *FOUR_NODES, f"train.max_memory_fraction={fraction - 0.01:.2f}"
    )
    assert code == 2 and "refused" in err


def test_summary_first_one_row_per_role_and_verbose_details(capsys, monkeypatch):
    code, out, _ = _dry_run(capsys, monkeypatch, *FOUR_NODES, "--master-addr", "10.0.0.1")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("placement: 4 A3 node(s)") and "launcher ray" in lines[0]
    head = "\n".join(lines[:12])
    for words in ("memory: ", "reserve", "of 64 GiB", "step time: ~", "AReaL-Ascend v1.0.5", "assumed"):
        assert words in head, words
    assert len(lines) < 45 and "trainer/1 " not in out and "VLLM_CPU_KVCACHE_SPACE" not in out
    # the trainer spans nodes 0-1: its rendezvous is node 0's address, in the summary and in the rows
    assert "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500" in head and out.count("MASTER_ADDR=10.0.0.1") == 2
    assert (
        "127.0.0.1" not in out and "<node0>" not in out and "--master-addr" not in out
    )  # given: no placeholder, no note asking
    code, verbose, _ = _dry_run(capsys, monkeypatch, *FOUR_NODES, "--verbose")
    assert "trainer/31" in verbose and "Ray placement groups" in verbose and "estimated peak" in verbose
    assert "give it with --master-addr ADDR (the recipe scripts: MASTER_ADDR=ADDR)" in verbose
