"""Placement: hand-computed plans for A2 (8 NPUs) and A3 (2 x 16 dies), the CPU's core split, a
brute-force disjointness/feasibility check over random layouts, errors that name the key and the
counts, the visible-devices variable per device kind, and ``train --dry-run`` as a user runs it."""

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu import platform as plat
from areal_npu.config import ConfigError
from areal_npu.placement import Cluster, TrainerLayout, describe_cluster, plan
from areal_npu.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "cpu" / "quickstart.yaml"
VISIBLE = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


def _engines(n, tp=1, **kwargs):
    return RolloutConfig(num_engines=n, tensor_parallel_size=tp, **kwargs)


def _layout(result):
    return [(p.name, p.node, p.devices) for p in result.processes]


# ---- the device seam ----


def test_visible_devices_env_per_kind():
    assert plat.visible_devices_env("npu", [4, 5]) == {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}
    assert plat.visible_devices_env("cuda", [3, 0]) == {
        "CUDA_VISIBLE_DEVICES": "3,0"
    }  # order = logical order
    assert plat.visible_devices_env("cpu", [0, 1, 2, 3, 8]) == {
        "AREAL_CPU_AFFINITY": "0-3,8",
        "OMP_NUM_THREADS": "5",
    }
    for bad in ([], [1, 1], [-1]):
        with pytest.raises(ValueError):
            plat.visible_devices_env("npu", bad)


def test_id_lists_read_and_write_taskset_syntax():
    assert plat.parse_id_list("0-3,8") == [0, 1, 2, 3, 8]
    assert plat.parse_id_list("5") == [5]
    assert plat.format_id_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert plat.format_id_list([3, 2]) == "3,2"
    for bad in ("GPU-6a1b", "3-1", "a,b", "1-"):
        with pytest.raises(ValueError):
            plat.parse_id_list(bad)


@given(st.lists(st.integers(0, 300), unique=True, max_size=40))
def test_id_list_round_trip(ids):
    assert plat.parse_id_list(plat.format_id_list(ids)) == ids


def test_visible_device_ids_are_physical_ids():
    assert plat.visible_device_ids("npu", env={"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}) == [4, 5, 6, 7]
    assert plat.visible_device_ids("cuda", env={}, count=2) == [0, 1]
    assert plat.visible_device_ids("cpu") == sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        plat.visible_device_ids("cuda", env={"CUDA_VISIBLE_DEVICES": "GPU-6a1b"})


def test_described_device_answers_for_auto_and_itself_without_probing():
    def no_torch_npu(name):
        raise ModuleNotFoundError(name)

    with plat.described_device("npu"):
        assert plat.select_device("auto", env={}, import_module=no_torch_npu).device_type == "npu"
        assert plat.select_device("npu", env={}, import_module=no_torch_npu).device_type == "npu"
        assert (
            plat.select_device("cpu", env={}).device_type == "cpu"
        )  # an explicit other device: this machine
    with pytest.raises(ValueError, match="no usable NPU"):
        plat.select_device("npu", env={}, import_module=no_torch_npu)


def test_trainer_layout_of_fsdp_and_megatron_configs():
    from areal_npu.train.config import MegatronLayoutConfig, TrainEngineConfig

    assert TrainerLayout.of(TrainEngineConfig()) == TrainerLayout()
    megatron = TrainEngineConfig(backend="megatron", megatron=MegatronLayoutConfig(tp_size=4, cp_size=2))
    layout = TrainerLayout.of(megatron)
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.world_size) == (1, 4, 1, 2, 8)
    with pytest.raises(ConfigError) as err:  # errors name the recipe keys
        plan(layout, _engines(1), Cluster.uniform("npu", 1, 2))
    assert err.value.key == "train.megatron.tp_size"
    with pytest.raises(ConfigError) as err:
        plan(TrainerLayout.of(TrainEngineConfig(dp_size=4)), _engines(1), Cluster.uniform("npu", 1, 3))
    assert err.value.key == "train.dp_size" and "3 available" in str(err.value)


# ---- hand-computed plans ----


def test_a2_node_trainer_first_then_engines():
    result = plan(TrainerLayout(dp=4), _engines(2, tp=2), Cluster.uniform("npu", 1, 8))
    assert _layout(result) == [
        ("trainer/0", 0, [0]), ("trainer/1", 0, [1]), ("trainer/2", 0, [2]), ("trainer/3", 0, [3]),
        ("engine/0", 0, [4, 5]), ("engine/1", 0, [6, 7]),
    ]  # fmt: skip
    assert result.processes[2].env == {
        "AREAL_NPU_DEVICE": "npu",
        "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3",
        "HCCL_IF_BASE_PORT": "64000",
        "RANK": "2",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    engine = result.processes[5].env
    assert engine["ASCEND_RT_VISIBLE_DEVICES"] == "6,7"
    assert engine["HCCL_IF_BASE_PORT"] == "64064"  # third HCCL job on the node: 2 windows of 32 on
    assert engine["VLLM_ASCEND_ENABLE_NZ"] == "0"  # the launcher's engine environment is included
    assert "RANK" not in engine and "CUDA_VISIBLE_DEVICES" not in engine
    assert result.weight_transport == {
        "name": "hccl",
        "drafter": "hccl",  # the broadcast carries the drafter too
        "group": ["trainer/0", "engine/0", "engine/1"],
        "group_world_size": 5,
        "sender_addr": "127.0.0.1",
    }
    assert result.idle == {} and result.notes == [] and not result.shared


def test_a3_two_nodes_trainer_fills_node0_engines_node1():
    cluster = Cluster.uniform("npu", 2, 16, node_addrs=("10.0.0.1", "10.0.0.2"), socket_ifname="eth0")
    result = plan(TrainerLayout(dp=8, tp=2), _engines(4, tp=4), cluster)
    assert [(p.rank, p.node, p.devices) for p in result.trainers] == [(r, 0, [r]) for r in range(16)]
    assert [(p.node, p.devices, p.host) for p in result.engines] == [
        (1, [0, 1, 2, 3], "10.0.0.2"), (1, [4, 5, 6, 7], "10.0.0.2"),
        (1, [8, 9, 10, 11], "10.0.0.2"), (1, [12, 13, 14, 15], "10.0.0.2"),
    ]  # fmt: skip
    # the trainer's rendezvous stays local (all its ranks on node 0); engines reach trainer rank 0 at node 0
    assert {p.env["MASTER_ADDR"] for p in result.trainers} == {"127.0.0.1"}
    assert result.weight_transport["sender_addr"] == "10.0.0.1"
    assert [p.env["HCCL_IF_BASE_PORT"] for p in result.engines] == ["64000", "64032", "64064", "64096"]
    assert all(p.env["HCCL_SOCKET_IFNAME"] == p.env["GLOO_SOCKET_IFNAME"] == "eth0" for p in result.processes)
    assert result.weight_transport["group_world_size"] == 17
    assert result.idle == {} and result.notes == []


def test_a3_engine_that_does_not_fit_the_rest_of_a_node_starts_the_next():
    result = plan(TrainerLayout(dp=12), _engines(2, tp=8), Cluster.uniform("npu", 2, 16))
    assert [(p.node, p.devices) for p in result.engines] == [(1, list(range(8))), (1, list(range(8, 16)))]
    assert result.idle == {0: [12, 13, 14, 15]}
    assert result.engines[0].host == "<node1>" and result.weight_transport["sender_addr"] == "<node0>"
    assert any("placeholders" in note for note in result.notes)
    assert any("HCCL_SOCKET_IFNAME" in note for note in result.notes)


def test_trainer_spilling_onto_a_second_node_and_uneven_torchrun_note():
    result = plan(TrainerLayout(dp=24), _engines(1, tp=8), Cluster.uniform("npu", 2, 16))
    node1 = [p for p in result.trainers if p.node == 1]
    assert [p.rank for p in node1] == list(range(16, 24))
    assert [p.env["LOCAL_RANK"] for p in node1] == [str(i) for i in range(8)]
    assert {p.env["MASTER_ADDR"] for p in result.trainers} == {"<node0>"}  # the ranks span two nodes
    assert node1[0].env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert (result.engines[0].node, result.engines[0].devices) == (1, list(range(8, 16)))
    assert result.engines[0].env["HCCL_IF_BASE_PORT"] == "64032"  # the trainer's job holds 64000 on node 1
    assert any("trainer ranks per node differ (16, 8)" in note for note in result.notes)


def test_trainer_tp_group_never_spans_nodes():
    # 6 devices per node, tp groups of 4: the second group starts node 1 (devices 4, 5 of node 0 stay idle)
    result = plan(TrainerLayout(dp=2, tp=4), _engines(1, tp=2), Cluster.uniform("cuda", 2, 6))
    assert [(p.node, p.devices[0]) for p in result.trainers] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    assert (result.engines[0].node, result.engines[0].devices) == (1, [4, 5])
    assert result.idle == {0: [4, 5]}
    assert result.engines[0].env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert "HCCL_IF_BASE_PORT" not in result.engines[0].env
    assert result.weight_transport["name"] == "nccl"


# ---- the CPU: cores ----


def test_cpu_quickstart_on_two_cores_gets_one_core_each():
    result = plan(TrainerLayout(), _engines(1), Cluster.uniform("cpu", 1, 2))
    trainer, engine = result.processes
    assert (trainer.devices, engine.devices) == ([0], [1])
    assert trainer.env["AREAL_CPU_AFFINITY"] == "0" and trainer.env["OMP_NUM_THREADS"] == "1"
    assert engine.env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and engine.env["AREAL_ENGINE_CPUS"] == "1"
    assert result.weight_transport["name"] == "rpc" and result.weight_transport["group"] is None
    assert not result.shared and result.notes == []


def test_cpu_shares_cores_with_a_note_instead_of_refusing():
    result = plan(TrainerLayout(), _engines(1), Cluster.uniform("cpu", 1, 1))
    assert [p.devices for p in result.processes] == [[0], [0]]
    assert result.shared and any("2 processes on 1 cores" in note for note in result.notes)
    result = plan(TrainerLayout(dp=2), _engines(2), Cluster.uniform("cpu", 1, 2))
    assert result.shared and sorted(len(p.devices) for p in result.processes) == [1, 1, 1, 1]
    assert any("4 processes on 2 cores" in note for note in result.notes)


def test_cpu_cores_split_evenly_trainer_takes_the_remainder():
    result = plan(TrainerLayout(), _engines(2, tp=2), Cluster.uniform("cpu", 1, 16))
    trainer, e0, e1 = result.processes
    # 5 processes-worth of slots (1 trainer + 2 x 2 tp ranks) on 16 cores: 3 each, the trainer 4
    assert (trainer.devices, e0.devices, e1.devices) == (
        [0, 1, 2, 3],
        [4, 5, 6, 7, 8, 9],
        list(range(10, 16)),
    )
    assert e0.env["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6|7,8,9"  # one core list per tp rank
    assert e1.env["AREAL_CPU_AFFINITY"] == "10-15" and e1.env["OMP_NUM_THREADS"] == "6"
    # detected cores need not be contiguous
    result = plan(TrainerLayout(), _engines(1), Cluster("cpu", 1, (2, 5, 7)))
    assert [p.devices for p in result.processes] == [[2, 5], [7]]


# ---- errors name the key and the counts ----


@pytest.mark.parametrize(
    ("trainer", "engines", "cluster", "key", "words"),
    [
        (
            TrainerLayout(dp=4),
            _engines(3, tp=2),
            Cluster.uniform("npu", 1, 8),
            "rollout.num_engines",
            ["10", "8 available"],
        ),
        (
            TrainerLayout(dp=1),
            _engines(1, tp=16),
            Cluster.uniform("npu", 1, 8),
            "rollout.tensor_parallel_size",
            ["16", "8"],
        ),
        (
            TrainerLayout(dp=20),
            _engines(1),
            Cluster.uniform("npu", 1, 16),
            "train.dp_size",
            ["20", "16 available"],
        ),
        (
            TrainerLayout(dp=2, tp=16),
            _engines(1),
            Cluster.uniform("npu", 4, 8),
            "train.megatron.tp_size",
            ["16", "8"],
        ),
        (
            TrainerLayout(dp=16),
            _engines(3, tp=8),
            Cluster.uniform("npu", 2, 16),
            "rollout.num_engines",
            ["40", "32 available"],
        ),
        # 16 devices are enough in total, but tp 3 leaves holes: room for 3 of 4 engines
        (
            TrainerLayout(dp=4),
            _engines(4, tp=3),
            Cluster.uniform("cuda", 2, 8),
            "rollout.num_engines",
            ["16", "3 of 4"],
        ),
        (
            TrainerLayout(),
            _engines(2, weight_transport="npu_ipc"),
            Cluster.uniform("npu", 2, 2),
            "rollout.weight_transport",
            ["engine/1"],
        ),
    ],
)
def test_what_does_not_fit_is_refused_naming_key_and_counts(trainer, engines, cluster, key, words):
    with pytest.raises(ConfigError) as err:
        plan(trainer, engines, cluster)
    assert err.value.key == key
    for word in words:
        assert word in str(err.value)


def test_ipc_transport_on_one_node_is_fine():
    result = plan(TrainerLayout(), _engines(1, weight_transport="npu_ipc"), Cluster.uniform("npu", 1, 8))
    assert result.weight_transport["name"] == "npu_ipc"


@pytest.mark.parametrize(("kind", "expected"), [("npu", "hccl"), ("cuda", "nccl"), ("cpu", "rpc")])
def test_auto_transport_per_kind_and_explicit_rpc_stays(kind, expected):
    assert (
        plan(TrainerLayout(), _engines(1), Cluster.uniform(kind, 1, 4)).weight_transport["name"] == expected
    )
    explicit = plan(TrainerLayout(), _engines(1, weight_transport="rpc"), Cluster.uniform(kind, 1, 4))
    assert explicit.weight_transport["name"] == "rpc"


# ---- property: disjoint, complete, tp groups on one node; refused exactly when nothing fits ----


def _feasible(groups_trainer, ttp, engines, tp, nodes, d):
    """Brute force: is there any count of trainer tp groups and engines per node that fits?"""

    @functools.cache
    def search(node, left_groups, left_engines):
        if node == nodes:
            return left_groups == 0 and left_engines == 0
        if left_groups * ttp + left_engines * tp > (nodes - node) * d:
            return False
        for g in range(min(left_groups, d // ttp) + 1):
            for e in range(min(left_engines, (d - g * ttp) // tp) + 1):
                if search(node + 1, left_groups - g, left_engines - e):
                    return True
        return False

    return search(0, groups_trainer, engines)


def _check_plan(result, trainer, engines, tp, cluster):
    kind, ids, nodes = cluster.kind, list(cluster.device_ids), cluster.nodes
    used = [(p.node, d) for p in result.processes for d in p.devices]
    assert len(used) == len(set(used)), "two processes share a device"
    assert all(0 <= node < nodes and d in ids for node, d in used)
    assert len(used) == trainer.world_size + engines * tp
    assert [p.rank for p in result.trainers] == list(range(trainer.world_size))
    assert [p.index for p in result.engines] == list(range(engines))
    for g in range(trainer.world_size // trainer.tp):
        assert len({p.node for p in result.trainers[g * trainer.tp : (g + 1) * trainer.tp]}) == 1
    for p in result.trainers:
        assert len(p.devices) == 1
        visible = [int(x) for x in p.env[VISIBLE[kind]].split(",")]
        assert visible[int(p.env["LOCAL_RANK"])] == p.devices[0]
        assert (p.env["RANK"], p.env["WORLD_SIZE"]) == (str(p.rank), str(trainer.world_size))
    for p in result.engines:
        assert len(p.devices) == tp and p.env[VISIBLE[kind]] == ",".join(map(str, p.devices))
    for node in range(nodes):
        mine = {d for n, d in used if n == node}
        assert mine | set(result.idle.get(node, [])) == set(ids) and not mine & set(result.idle.get(node, []))
    if kind == "npu":  # one HCCL port window per job and node
        jobs = Counter()
        for node in range(nodes):
            bases = {p.env["HCCL_IF_BASE_PORT"] for p in result.trainers if p.node == node}
            bases = [*bases, *(p.env["HCCL_IF_BASE_PORT"] for p in result.engines if p.node == node)]
            jobs.update((node, b) for b in bases)
        assert max(jobs.values(), default=1) == 1


POW2 = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(["npu", "cuda"]),
    d=st.sampled_from([8, 16]),
    nodes=st.integers(1, 4),
    dp=st.integers(1, 4),
    ttp=POW2,
    pp=st.sampled_from([1, 2]),
    cp=st.sampled_from([1, 2]),
    engines=st.integers(1, 6),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_random_layouts_are_disjoint_complete_or_refused(kind, d, nodes, dp, ttp, pp, cp, engines, tp):
    """With tp sizes that divide the node size (A2/A3 layouts), the planner refuses exactly the
    layouts for which no per-node count of trainer tp groups and engines fits (brute force), and
    what it plans passes an independent check."""
    trainer = TrainerLayout(dp=dp, tp=ttp, pp=pp, cp=cp)
    cluster = Cluster.uniform(kind, nodes, d)
    fits = _feasible(trainer.world_size // ttp, ttp, engines, tp, nodes, d)
    try:
        result = plan(trainer, _engines(engines, tp=tp), cluster)
    except ConfigError as exc:
        assert not fits, f"refused a layout that fits: {exc}"
        need = trainer.world_size + engines * tp
        if exc.key == "rollout.num_engines":
            assert str(need) in str(exc) and f"{nodes * d} available" in str(exc)
        else:
            assert exc.key in ("rollout.tensor_parallel_size", "train.dp_size", "train.megatron.pp_size",
                               "train.megatron.cp_size", "train.megatron.tp_size")  # fmt: skip
        return
    assert fits
    _check_plan(result, trainer, engines, tp, cluster)


@settings(max_examples=150, deadline=None)
@given(
    cores=st.integers(1, 24),
    nodes=st.integers(1, 2),
    dp=st.integers(1, 4),
    engines=st.integers(1, 4),
    tp=st.integers(1, 3),
)
def test_cpu_plans_always_exist_and_are_disjoint_unless_marked_shared(cores, nodes, dp, engines, tp):
    result = plan(TrainerLayout(dp=dp), _engines(engines, tp=tp), Cluster.uniform("cpu", nodes, cores))
    used = [(p.node, c) for p in result.processes for c in p.devices]
    assert all(p.devices for p in result.processes)  # every process has at least one core
    assert all(0 <= c < cores for _, c in used)
    for p in result.processes:
        assert plat.parse_id_list(p.env["AREAL_CPU_AFFINITY"]) == sorted(p.devices)
    if not result.shared:
        assert len(used) == len(set(used))
        assert result.notes == [] or nodes > 1
    else:
        assert any("shared" in note for note in result.notes)
    assert (dp + engines * tp <= nodes * cores) or result.shared


# ---- describing the cluster ----


def test_describe_cluster_detects_cpu_cores_and_needs_flags_for_absent_accelerators(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {2, 5})
    cluster = describe_cluster("cpu")
    assert (cluster.nodes, cluster.device_ids, cluster.source) == (1, (2, 5), "detected")
    assert describe_cluster("npu", 2, 16) == Cluster.uniform("npu", 2, 16)
    if plat.current_platform().device_type != "npu":
        with pytest.raises(ConfigError) as err:
            describe_cluster("npu")
        assert err.value.key == "--devices-per-node"


# ---- the command line ----


def _train(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "areal_npu.cli", "train", str(QUICKSTART), *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip


def test_dry_run_json_for_two_a3_nodes_starts_nothing(tmp_path):
    out = _train(
        tmp_path, "--dry-run", "--json", "--nodes", "2", "--devices-per-node", "16", "--device-kind", "npu"
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["device_kind"], data["nodes"], len(data["device_ids"])) == ("npu", 2, 16)
    assert [(p["name"], p["node"], p["devices"]) for p in data["processes"]] == [
        ("trainer/0", 0, [0]),
        ("engine/0", 0, [1]),
    ]
    assert data["processes"][1]["env"]["ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert data["weight_transport"]["name"] == "hccl"
    assert any("'cpu'" in note for note in data["notes"])  # the recipe's own device is said, not hidden
    assert not (tmp_path / "runs").exists()  # no run directory: nothing was started
    assert "Traceback" not in out.stderr


def test_dry_run_table_on_this_machine(tmp_path):
    out = _train(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("placement: 1 node(s)")  # the summary first
    for word in ("│ trainer", "│ engine", "AREAL_CPU_AFFINITY", "weight transport: rpc"):  # one row per role
        assert word in out.stdout
    assert "trainer/0" not in out.stdout
    verbose = _train(tmp_path, "--dry-run", "--verbose")  # every process, with its environment
    for word in ("trainer/0", "engine/0", "AREAL_CPU_AFFINITY", "estimated peak"):
        assert word in verbose.stdout
    assert not (tmp_path / "runs").exists()


def test_role_rows_collapse_ranks_into_shared_and_varying_environment():
    from areal_npu.placement.describe import role_rows

    result = plan(
        TrainerLayout(dp=2, tp=8), _engines(4, tp=4), Cluster.uniform("npu", 2, 16, master_addr="10.0.0.1")
    )
    trainer, engine = role_rows(result)
    assert (trainer["count"], trainer["nodes"], trainer["devices"]) == ("16 rank(s)", "0", "node 0: 0-15")
    # what every rank shares is shown once; what differs is named with its range
    assert "WORLD_SIZE=16" in trainer["env"] and "RANK=" not in trainer["env"].replace("WORLD_SIZE", "")
    assert trainer["per process"] == "RANK (0..15), LOCAL_RANK (0..15)"
    assert (engine["count"], engine["devices"]) == ("4 x tp 4", "0-3, 4-7, 8-11, 12-15")
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine["env"] + engine["per process"]  # an NPU engine
    assert (
        engine["per process"]
        == "ASCEND_RT_VISIBLE_DEVICES (0,1,2,3..12,13,14,15), HCCL_IF_BASE_PORT (64000..64096)"
    )
    assert result.weight_transport["sender_addr"] == "10.0.0.1" and result.engines[0].host == "<node1>"
    assert not any("--master-addr" in n for n in result.notes) and any("<node1>" in n for n in result.notes)


def test_dry_run_validates_for_the_described_device(tmp_path):
    """``device: npu`` cannot validate on a machine without one, but ``--device-kind npu`` describes
    the machines the recipe is for: validated and planned there, with no note about a mismatch."""
    args = ["device=npu", "--dry-run", "--json", "--device-kind", "npu", "--devices-per-node", "8"]
    out = _train(tmp_path, *args)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["device_kind"] == "npu" and data["notes"] == []
    assert data["weight_transport"]["name"] == "hccl"
    # without --device-kind the plan is for the recipe's device, as --help says (it was refused here)
    same = _train(tmp_path, "device=npu", "--dry-run", "--json", "--devices-per-node", "8")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["device_kind"] == "npu"
    if plat.current_platform().device_type != "npu":  # a real run on this machine is still refused
        out = _train(tmp_path, "device=npu", "--check")
        assert out.returncode == 2 and "device" in out.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nodes", "2"], ["--nodes", "--dry-run"]),
        (["--json"], ["--json", "--dry-run"]),
        (["--dry-run", "--check"], ["--dry-run", "--check"]),
        (
            [
                "--dry-run",
                "--device-kind",
                "npu",
                "--devices-per-node",
                "8",
                "rollout.num_engines=4",
                "rollout.tensor_parallel_size=2",
            ],
            ["rollout.num_engines", "9", "8 available"],
        ),  # fmt: skip
    ],
)
def test_dry_run_refusals_exit_2(tmp_path, args, words):
    out = _train(tmp_path, *args)
    assert out.returncode == 2
    for word in words:
        assert word in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()
