"""The plan -> Ray placement groups mapping (``launch/ray_bundles.py``), a pure function, checked
against the plan itself: every process gets exactly one bundle, in the group of its node, asking
for its own devices under the device seam's resource name; a group fits its node. Also the
cluster a Ray cluster describes, the engine bundles rank 0 is handed, and (without Ray, with a
stand-in server) an engine actor's start moving off a port taken before it binds."""

import pytest

from areal_npu import platform as plat
from areal_npu.launch.ray_bundles import NODE_PIN, cluster_from_ray, placement_groups, placements
from areal_npu.launch.ray_launch import engine_spec
from areal_npu.placement import Cluster, TrainerLayout, plan
from areal_npu.rollout.config import RolloutConfig

LAYOUTS = [
    # kind, nodes, devices per node, trainer layout, engines, engine tp
    ("cpu", 1, 8, TrainerLayout(dp=2), 2, 1),  # the quickstart's 2+2 on 8 cores
    ("cpu", 1, 2, TrainerLayout(dp=2), 2, 1),  # 2+2 on 2 cores: shared
    ("cpu", 1, 3, TrainerLayout(dp=1), 4, 1),  # 5 processes on 3 cores: shared, uneven
    ("npu", 1, 16, TrainerLayout(dp=2, tp=4), 2, 4),
    ("npu", 2, 16, TrainerLayout(dp=4, tp=4), 4, 4),  # trainer on node 0, engines on node 1
    ("cuda", 2, 8, TrainerLayout(dp=2, tp=2, cp=2), 3, 2),
]


def _plan(kind, nodes, per_node, layout, engines, tp):
    cluster = Cluster.uniform(kind, nodes, per_node, node_addrs=tuple(f"10.0.0.{i}" for i in range(nodes)))
    return plan(layout, RolloutConfig(num_engines=engines, tensor_parallel_size=tp, device=kind), cluster)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}-{layout[1]}x{layout[2]}")
def test_one_bundle_per_process_in_its_nodes_group(layout):
    result = _plan(*layout)
    resource = plat.PROFILES[result.device_kind].ray_resource
    spots = placements(result)
    groups = placement_groups(result)
    assert [s.process for s in spots] == [p.name for p in result.processes]
    nodes = sorted({p.node for p in result.processes})
    assert len(groups) == len(nodes)  # one group per plan node that holds processes
    for node, bundles in zip(nodes, groups):
        on_node = [p for p in result.processes if p.node == node]
        assert len(bundles) == len(on_node)
        # the k-th process of the node (plan order) is bundle k of that node's group
        for k, p in enumerate(on_node):
            spot = spots[result.processes.index(p)]
            assert (spot.group, spot.bundle, spot.node) == (nodes.index(node), k, node)
            assert bundles[k] == spot.resources and set(spot.resources) == {resource}
        total = sum(b[resource] for b in bundles)
        assert total <= len(result.device_ids) + 1e-9  # a group fits its node
        if not result.shared:  # each process asks for exactly the devices the plan gave it
            assert [b[resource] for b in bundles] == [len(p.devices) for p in on_node]
        else:  # shared cores: equal shares that add up to (at most) the node's cores, within Ray's 1e-4
            shares = {b[resource] for b in bundles}
            assert len(shares) == 1 and len(result.device_ids) - total < 1e-4 * len(bundles)


def test_each_group_is_pinned_to_its_plan_nodes_address():
    """Ray places a STRICT_PACK group on any node that fits; the plan gave node 0's ranks the
    rendezvous (MASTER_ADDR), so each group's first bundle asks for a sliver of its node's
    ``node:<address>`` resource (Ray gives every node 1 of its own)."""
    result = _plan("cpu", 2, 2, TrainerLayout(dp=3), 1, 1)  # tests/launch/test_two_nodes_netns.py's
    addrs = ("10.0.0.0", "10.0.0.1")
    assert {p.env["MASTER_ADDR"] for p in result.trainers} == {addrs[0]} and result.engines[0].node == 1
    pinned, plain = placement_groups(result, addrs), placement_groups(result)
    for node, (bundles, unpinned) in enumerate(zip(pinned, plain)):
        pins = [{k: v for k, v in b.items() if k.startswith("node:")} for b in bundles]
        assert pins == [{f"node:{addrs[node]}": NODE_PIN}] + [{}] * (len(bundles) - 1)
        assert [{k: v for k, v in b.items() if not k.startswith("node:")} for b in bundles] == unpinned
    assert 0 < NODE_PIN < 1


def test_engine_spec_names_each_engines_bundle():
    result = _plan("npu", 2, 16, TrainerLayout(dp=4, tp=4), 4, 4)
    spots = placements(result)
    spec = engine_spec(result, spots, ["g0", "g1"], "10.0.0.0:6379", "/run/ray")
    assert [e["process"] for e in spec["engines"]] == [p.name for p in result.engines]
    for engine, p in zip(spec["engines"], result.engines):
        assert engine["group"] == ("g0", "g1")[p.node]
        assert engine["bundle"] == [q.name for q in result.processes if q.node == p.node].index(p.name)
        assert engine["resources"] == {"NPU": float(p.tp)} and engine["env"] == p.env
        assert engine["host"] is None  # several nodes: the engine listens on its Ray node's address
    one_node = _plan("cpu", 1, 8, TrainerLayout(dp=2), 2, 1)
    assert {e["host"] for e in engine_spec(one_node, placements(one_node), ["g"], "a", "r")["engines"]} == {
        "127.0.0.1"
    }


def _node(addr, head=False, alive=True, **resources):
    extra = {"node:__internal_head__": 1.0} if head else {}
    return {"Alive": alive, "NodeManagerAddress": addr, "Resources": {**resources, **extra}}


def test_cluster_from_ray_nodes():
    nodes = [
        _node("10.0.0.9", NPU=16.0, CPU=192.0),
        _node("10.0.0.5", head=True, NPU=16.0, CPU=192.0),
        _node("10.0.0.7", alive=False, NPU=16.0),
        _node("10.0.0.8", NPU=8.0, CPU=192.0),
        _node("10.0.0.1", CPU=64.0),  # no NPUs: not a node of an NPU run
    ]
    cluster = cluster_from_ray("npu", nodes, cpu_ids=[0, 1])
    assert cluster.node_addrs == ("10.0.0.5", "10.0.0.8", "10.0.0.9")  # head first, then by address
    assert cluster.device_ids == tuple(range(8))  # the fewest any node has
    local = cluster_from_ray("cpu", [_node("192.0.2.2", head=True, CPU=2.0)], cpu_ids=[0, 1])
    assert (local.nodes, local.device_ids, local.node_addrs) == (1, (0, 1), ())
    with pytest.raises(ValueError, match="no alive node with GPU"):
        cluster_from_ray("cuda", nodes, cpu_ids=[0])


# a stand-in engine server (no vLLM): serves /health on its port, or fails to bind it
_FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_engine_start_moves_off_a_port_taken_before_it_binds(tmp_path, monkeypatch):
    """The port an engine picked is taken before it binds (held here): the actor starts it again on
    a new free port; other start failures are not retried."""
    import socket
    import sys

    from areal_npu.launch.engine_process import EngineProcess, EngineStartError
    from areal_npu.launch.ray_actors import EngineRunner

    class FakeEngine(EngineProcess):
        def command(self):
            return [
                sys.executable,
                "-c",
                _FAKE_SERVER if self.port != -1 else "raise SystemExit(3)",
                str(self.port),
            ]

    cfg = RolloutConfig(model="m", device="cpu", startup_timeout_s=30, log_dir=str(tmp_path))
    runner = EngineRunner("engine/0", cfg.to_json(), 0, {}, "cpu", "secret", str(tmp_path), host="127.0.0.1")
    monkeypatch.setattr(runner, "_report", lambda **extra: {"url": runner.engine.url})  # no Ray here
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        runner.engine = FakeEngine(cfg, port=taken, secret="secret")
        try:
            report = runner.start()
            assert runner.engine.port != taken and report["url"].endswith(f":{runner.engine.port}")
            assert runner.engine.healthy()
        finally:
            runner.engine.stop(grace_s=2)
    runner.engine = FakeEngine(cfg, port=-1, secret="secret")  # fails for another reason: no retry
    starts = []
    original = FakeEngine._start_once  # the retries happen inside start(): count the attempts
    monkeypatch.setattr(FakeEngine, "_start_once", lambda self: starts.append(1) or original(self))
    with pytest.raises(EngineStartError, match="exited with code 3"):
        runner.start()
    assert len(starts) == 1
