"""A :class:`~areal_npu.placement.model.Plan` as Ray placement groups, and the cluster a Ray
cluster describes -- pure functions, no Ray import (the Ray launcher, ``ray_launch.py``, feeds
them ``ray.nodes()`` and hands their output to Ray).

Why one placement group per plan node: a plan node's processes share that node's devices (and,
across nodes, its address), so their bundles must land on one Ray node (``STRICT_PACK``); Ray has
no "these bundles together, those apart" inside one group. Each group asks for the whole of what
its node's processes hold, so on full nodes two groups cannot share a Ray node.

One bundle per process: ``{resource: devices}`` with the device seam's Ray resource name
(``NPU``, ``GPU``, ``CPU``: ``platform.PROFILES[kind].ray_resource``). On the CPU the devices are
cores: a process asks for as many CPUs as it has cores; when the plan shares cores (more
processes than cores on a node) each process on the node asks for an equal fraction of them, so
the group fits the node as the plan does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_npu import platform as plat
from areal_npu.placement.model import Cluster, Plan

#: Ray rounds resource amounts to 1e-4; a fraction rounded down keeps a node's sum within it.
_RAY_RESOLUTION = 10_000
#: the share of a node's ``node:<address>`` resource (1 per node) that pins a group to it
NODE_PIN = 0.001


@dataclass(frozen=True)
class Placement:
    """Where one planned process goes: group ``group`` (plan node ``node``), bundle ``bundle``."""

    process: str  # ProcessPlan.name
    node: int
    group: int
    bundle: int
    resources: dict[str, float]


def _cpu_share(cores: int, processes: int) -> float:
    return math.floor(cores / processes * _RAY_RESOLUTION) / _RAY_RESOLUTION


def placements(plan: Plan) -> list[Placement]:
    """One :class:`Placement` per process of ``plan``, in plan order; groups in node order."""
    resource = plat.PROFILES[plan.device_kind].ray_resource
    nodes = sorted({p.node for p in plan.processes})
    out, taken = [], dict.fromkeys(nodes, 0)
    for p in plan.processes:
        if plan.device_kind == "cpu" and plan.shared:
            on_node = sum(1 for q in plan.processes if q.node == p.node)
            amount = _cpu_share(len(plan.device_ids), on_node)
        else:
            amount = float(len(p.devices))
        out.append(Placement(p.name, p.node, nodes.index(p.node), taken[p.node], {resource: amount}))
        taken[p.node] += 1
    return out


def placement_groups(plan: Plan, node_addrs: tuple[str, ...] = ()) -> list[list[dict[str, float]]]:
    """The bundles of each placement group (one group per plan node, in node order). With the
    cluster's ``node_addrs`` each group's first bundle also asks for a sliver of Ray's
    ``node:<address>`` resource of its plan node, so the group lands on that node: the plan gave
    the ranks there their MASTER_ADDR (node 0's address) and Ray alone would pick any node that fits."""
    groups: dict[int, list[dict[str, float]]] = {}
    for spot in placements(plan):
        bundle = dict(spot.resources)
        if node_addrs and spot.group not in groups:
            bundle[f"node:{node_addrs[spot.node]}"] = NODE_PIN
        groups.setdefault(spot.group, []).append(bundle)
    return [groups[g] for g in sorted(groups)]


def cluster_from_ray(kind: str, nodes: list[dict], cpu_ids: tuple[int, ...] | list[int]) -> Cluster:
    """The :class:`Cluster` a Ray cluster describes: its alive nodes that have ``kind``'s resource
    (``ray.nodes()`` entries), the head node first (trainer rank 0 and the rendezvous go there),
    then by address. Devices per node: the fewest any such node has (the planner assumes alike
    nodes). On the CPU the core ids are ``cpu_ids`` (this machine's affinity; Ray counts CPUs, it
    does not name them)."""
    resource = plat.PROFILES[kind].ray_resource
    alive = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get(resource, 0) >= 1]
    if not alive:
        raise ValueError(f"the Ray cluster has no alive node with {resource} resources (device kind {kind})")
    alive.sort(key=lambda n: (not _is_head(n), n.get("NodeManagerAddress", "")))
    addrs = tuple(n.get("NodeManagerAddress", "") for n in alive)
    if kind == "cpu":
        ids = tuple(cpu_ids)
    else:
        ids = tuple(range(int(min(n["Resources"][resource] for n in alive))))
    return Cluster(kind, len(alive), ids, node_addrs=addrs if len(alive) > 1 else (), source="ray")


def _is_head(node: dict) -> bool:
    return any(key.startswith("node:__internal_head__") for key in node.get("Resources", {}))
