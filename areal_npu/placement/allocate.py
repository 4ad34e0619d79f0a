"""The planner: trainer tp groups then engines onto the nodes' devices (a greedy cursor), CPU core
sets, HCCL port windows, each process's environment, the weight transport and the plan's notes
(:mod:`areal_npu.placement` describes the policy)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from areal_npu import platform as plat
from areal_npu.config import ConfigError
from areal_npu.placement.env import ENGINE_CPUS_ENV, OMP_BIND_ENV
from areal_npu.placement.model import (
    ENGINE_TP_KEY,
    ENGINES_KEY,
    HCCL_MAX_BASE_PORT,
    HCCL_PORT_WINDOW,
    IFNAME_VARS,
    IPC_TRANSPORTS,
    TRANSPORT_KEY,
    Cluster,
    Plan,
    ProcessPlan,
    TrainerLayout,
)


class _Cursor:
    """Greedy slot allocator over ``nodes`` x ``size`` slots: each group on one node, at the next
    free slots; a group that does not fit on the rest of the node starts the next one. With
    ``share`` it wraps around (node 0 again; a group larger than a node wraps inside it)."""

    def __init__(self, nodes: int, size: int, share: bool = False):
        self.nodes, self.size, self.share = nodes, size, share
        self.node, self.pos = 0, 0

    def place(self, count: int) -> tuple[int, list[int]] | None:
        if self.node < self.nodes and self.pos + count > self.size and not (self.share and self.pos == 0):
            self.node, self.pos = self.node + 1, 0
        if self.node >= self.nodes:
            if not self.share:
                return None
            self.node, self.pos = 0, 0
        node, slots = self.node, [(self.pos + i) % self.size for i in range(count)]
        self.pos += count
        if self.share and self.pos >= self.size:
            self.node, self.pos = self.node + 1, 0
        return node, slots

    def free(self, node: int) -> int:
        """Slots later groups can still take on ``node`` (the cursor only moves forward)."""
        if node < self.node:
            return 0
        return self.size - self.pos if node == self.node else self.size


def _fit_error(
    trainer: TrainerLayout, engines: int, tp: int, cluster: Cluster, placed: int, free: list[int]
) -> ConfigError:
    d, n = cluster.devices_per_node, cluster.nodes
    need = trainer.world_size + engines * tp
    counts = (f"needs {trainer.world_size} trainer + {engines} engines x tp {tp} = {need} {cluster.kind} devices; "
              f"{n} node(s) x {d} = {n * d} available")  # fmt: skip
    if need <= n * d:
        counts += (f", but an engine's tp group must lie on one node: after the trainer, engines can use "
                   f"{', '.join(map(str, free))} devices on node(s) {', '.join(map(str, range(n)))}, "
                   f"room for {placed} of {engines} engines")  # fmt: skip
    return ConfigError(ENGINES_KEY, counts)


def _allocate(trainer: TrainerLayout, engines: int, tp: int, cluster: Cluster, share: bool):
    """[(node, slots)] for every trainer tp group, then every engine; ConfigError if it does not fit."""
    d = cluster.devices_per_node
    if not share and trainer.tp > d:
        raise ConfigError(
            trainer.key("tp"), f"a trainer tp group ({trainer.tp} ranks) must lie on one node of {d} devices"
        )
    if not share and tp > d:
        raise ConfigError(
            ENGINE_TP_KEY, f"an engine's tp group ({tp} devices) must lie on one node of {d} devices"
        )
    cursor = _Cursor(cluster.nodes, d, share)
    groups = []
    for _ in range(trainer.world_size // trainer.tp):
        spot = cursor.place(trainer.tp)
        if spot is None:
            raise ConfigError(
                trainer.size_key(),
                f"the trainer needs {trainer.describe()} {cluster.kind} devices (tp groups of {trainer.tp} on one node); "
                f"{cluster.nodes} node(s) x {d} = {cluster.nodes * d} available",
            )
        groups.append(spot)
    free = [cursor.free(node) for node in range(cluster.nodes)]
    for i in range(engines):
        spot = cursor.place(tp)
        if spot is None:
            raise _fit_error(trainer, engines, tp, cluster, i, free)
        groups.append(spot)
    return groups


def _cpu_cores(units: list[tuple[int, int]], cores: tuple[int, ...]) -> dict[tuple[int, int], list[int]]:
    """Disjoint CPU plan: split each node's cores among the (node, slot) units placed there, in
    slot order, as evenly as possible (earlier slots, the trainer's, take the remainder)."""
    by_node: dict[int, list[tuple[int, int]]] = {}
    for unit in units:
        by_node.setdefault(unit[0], []).append(unit)
    out = {}
    for on_node in by_node.values():
        base, extra = divmod(len(cores), len(on_node))
        start = 0
        for k, unit in enumerate(sorted(on_node, key=lambda u: u[1])):
            width = base + (1 if k < extra else 0)
            out[unit] = list(cores[start : start + width])
            start += width
    return out


def plan(trainer: TrainerLayout, rollout, cluster: Cluster) -> Plan:
    """Place ``trainer`` and ``rollout.num_engines`` engines of ``rollout.tensor_parallel_size`` on
    ``cluster`` (``rollout``: a :class:`~areal_npu.rollout.config.RolloutConfig`). Raises ConfigError."""
    trainer.validate()
    cluster.validate()
    engines, tp = rollout.num_engines, rollout.tensor_parallel_size
    if engines < 1:
        raise ConfigError(ENGINES_KEY, f"must be >= 1; got {engines}")
    if tp < 1:
        raise ConfigError(ENGINE_TP_KEY, f"must be >= 1; got {tp}")
    kind, ids = cluster.kind, cluster.device_ids
    shared = False
    try:
        groups = _allocate(trainer, engines, tp, cluster, share=False)
    except ConfigError:
        if kind != "cpu":
            raise
        groups = _allocate(trainer, engines, tp, cluster, share=True)
        shared = True

    # one (node, slot) per process-unit: trainer ranks in rank order, then each engine's tp ranks
    n_groups = trainer.world_size // trainer.tp
    trainer_units = [(node, s) for node, slots in groups[:n_groups] for s in slots]
    engine_units = [[(node, s) for s in slots] for node, slots in groups[n_groups:]]
    all_units = trainer_units + [u for units in engine_units for u in units]
    if kind == "cpu" and not shared:
        cores = _cpu_cores(all_units, ids)
        devices_of = lambda unit: cores[unit]  # noqa: E731
    else:
        devices_of = lambda unit: [ids[unit[1]]]  # noqa: E731
    multi_node = len({node for node, _ in all_units}) > 1
    common = {plat.DEVICE_ENV: kind}
    if multi_node and cluster.socket_ifname:
        common.update({var: cluster.socket_ifname for var in IFNAME_VARS[kind]})
    hccl = _HcclPorts(cluster.hccl_base_port) if kind == "npu" else None

    processes = _trainer_processes(trainer, trainer_units, devices_of, cluster, common, hccl)
    engine_cfg = dataclasses.replace(rollout, device=kind)  # the launcher's view, on the planned kind
    for index, units in enumerate(engine_units):
        node = units[0][0]
        per_rank = [devices_of(u) for u in units]
        devices = sorted({d for ds in per_rank for d in ds}) if shared else [d for ds in per_rank for d in ds]
        env = {**common, **engine_cfg.engine_env(), **plat.visible_devices_env(kind, devices)}
        if hccl is not None:
            env.update(hccl.next({node}))
        if kind == "cpu":
            env[OMP_BIND_ENV] = "|".join(",".join(map(str, ds)) for ds in per_rank)
            env[ENGINE_CPUS_ENV] = ",".join(map(str, devices))
        host = cluster.addr(node) if multi_node else rollout.host
        port = rollout.base_port + index if rollout.base_port else None
        processes.append(
            ProcessPlan(
                f"engine/{index}", "engine", node, devices, env, index=index, tp=tp, host=host, port=port
            )
        )

    sender = trainer_units[0][0]
    transport = _transport(engine_cfg, processes, sender, cluster.addr(sender) if multi_node else "127.0.0.1")
    taken = {(p.node, d) for p in processes for d in p.devices}
    idle = {n: [d for d in ids if (n, d) not in taken] for n in range(cluster.nodes)}
    idle = {n: free for n, free in idle.items() if free}
    notes = _notes(cluster, all_units, processes, shared, multi_node)
    return Plan(
        kind, cluster.nodes, list(ids), trainer, engines, tp, processes, transport, idle, shared, notes
    )


class _HcclPorts:
    """One HCCL_IF_BASE_PORT window per HCCL job (the trainer, each engine) and node."""

    def __init__(self, base: int):
        self.base, self.jobs = base, {}  # node -> windows handed out there

    def next(self, nodes: set[int]) -> dict[str, str]:
        slot = max(self.jobs.get(node, 0) for node in nodes)  # a job spanning nodes: one base on all
        for node in nodes:
            self.jobs[node] = slot + 1
        port = self.base + HCCL_PORT_WINDOW * slot
        if port > HCCL_MAX_BASE_PORT:  # CANN's limit for the base
            raise ConfigError(
                ENGINES_KEY, f"{slot + 1} HCCL jobs on one node need a base port above {HCCL_MAX_BASE_PORT}"
            )
        return {"HCCL_IF_BASE_PORT": str(port)}


def _trainer_processes(trainer, units, devices_of, cluster, common, hccl) -> list[ProcessPlan]:
    kind = cluster.kind
    nodes = {node for node, _ in units}
    # the trainer's own rendezvous: local while all its ranks share a node
    master = cluster.addr(units[0][0]) if len(nodes) > 1 else "127.0.0.1"
    job = hccl.next(nodes) if hccl is not None else {}
    processes = []
    for rank, unit in enumerate(units):
        node = unit[0]
        on_node = [u for u in units if u[0] == node]
        if kind == "cpu":
            visible = plat.visible_devices_env(kind, devices_of(unit))
        else:  # one list per node, as torchrun starts them; LOCAL_RANK picks the rank's device
            visible = plat.visible_devices_env(kind, [d for u in on_node for d in devices_of(u)])
        env = {**common, **visible, **job,
               "RANK": str(rank), "LOCAL_RANK": str(on_node.index(unit)), "WORLD_SIZE": str(trainer.world_size),
               "LOCAL_WORLD_SIZE": str(len(on_node)), "MASTER_ADDR": master, "MASTER_PORT": str(cluster.master_port)}  # fmt: skip
        processes.append(ProcessPlan(f"trainer/{rank}", "trainer", node, devices_of(unit), env, rank=rank))
    return processes


def _notes(cluster, all_units, processes, shared, multi_node) -> list[str]:
    notes = []
    if shared:
        per_node: dict[int, list[int]] = {}
        for node, slot in all_units:
            per_node.setdefault(node, []).append(slot)
        crowded = ", ".join(f"node {n}: {len(s)} processes on {len(set(s))} cores"
                            for n, s in sorted(per_node.items()) if len(s) > len(set(s)))  # fmt: skip
        notes.append(f"CPU cores are shared ({crowded}): processes sharing a core slow each other down")
    per_node_ranks = Counter(p.node for p in processes if p.role == "trainer")
    if len(set(per_node_ranks.values())) > 1:
        counts = ", ".join(str(per_node_ranks[n]) for n in sorted(per_node_ranks))
        notes.append(
            f"trainer ranks per node differ ({counts}): torchrun starts the same number on every node"
        )
    if multi_node and not cluster.node_addrs:
        others = f"<node1>..<node{cluster.nodes - 1}>" if cluster.nodes > 2 else "<node1>"
        if not cluster.master_addr:
            notes.append("node 0's address is a placeholder (<node0>): give it with --master-addr ADDR "
                         "(the recipe scripts: MASTER_ADDR=ADDR)")  # fmt: skip
        notes.append(f"the other nodes' addresses ({others}) are placeholders: the Ray launcher "
                     "(--launcher ray, the recipe scripts' LAUNCHER=ray) takes them from the nodes that join")  # fmt: skip
    if multi_node and not cluster.socket_ifname:
        notes.append(
            f"several nodes: set {' and '.join(IFNAME_VARS[cluster.kind])} to the interface between them"
        )
    return notes


def _transport(
    engine_cfg, processes: list[ProcessPlan], sender_node: int, sender_addr: str
) -> dict[str, Any]:
    """The weight transport as the rollout config resolves it for the planned kind, with its group:
    trainer rank 0 (it exports the weights; ``sender_addr`` is where engines reach it) and every
    engine worker."""
    name = engine_cfg.resolved_transport()
    engines = [p for p in processes if p.role == "engine"]
    if name == "rpc":
        return {"name": "rpc", "drafter": "rpc", "group": None, "group_world_size": None, "sender_addr": None}
    if name in IPC_TRANSPORTS:
        away = [p.name for p in engines if p.node != sender_node]
        if away:
            raise ConfigError(
                TRANSPORT_KEY,
                f"{name!r} hands over node-local memory handles, but {', '.join(away)} run on another node than "
                "trainer rank 0; use auto (a collective) or rpc",
            )
    return {
        "name": name,
        "drafter": name,  # the broadcast carries the MTP drafter too (rollout/transports.py)
        "group": ["trainer/0"] + [p.name for p in engines],
        "group_world_size": 1 + sum(p.tp for p in engines),
        "sender_addr": sender_addr,
    }


def plan_recipe(cfg, cluster: Cluster) -> Plan:
    """The plan of a validated recipe (an ``RLConfig``) on ``cluster``."""
    result = plan(TrainerLayout.of(cfg.train), cfg.rollout, cluster)
    if cfg.device != cluster.kind:
        result.notes.insert(
            0,
            f"the recipe's device is {cfg.device!r} on this machine; this plan is for {cluster.kind} as described",
        )
    return result
