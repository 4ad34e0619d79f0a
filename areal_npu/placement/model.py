"""The planner's data: the trainer's layout, the cluster, the plan and its processes, and the recipe
keys errors name (:mod:`areal_npu.placement` describes the policy)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from areal_npu import platform as plat
from areal_npu.config import ConfigError

#: Recipe keys the trainer's layout comes from (errors name them): ``train.dp_size`` and the
#: Megatron engine's ``train.megatron.*`` (the FSDP2 engine has dp only).
TRAINER_KEYS = {
    "dp": "train.dp_size",
    "tp": "train.megatron.tp_size",
    "pp": "train.megatron.pp_size",
    "cp": "train.megatron.cp_size",
}
ENGINES_KEY = "rollout.num_engines"
ENGINE_TP_KEY = "rollout.tensor_parallel_size"
TRANSPORT_KEY = "rollout.weight_transport"
#: A communicator root's HCCL host-port window (CANN 9.0: 32 ports from HCCL_IF_BASE_PORT).
HCCL_PORT_WINDOW = 32
HCCL_MAX_BASE_PORT = 65520
IPC_TRANSPORTS = ("npu_ipc", "cuda_ipc")
IFNAME_VARS = {"npu": ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"), "cuda": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"),
               "cpu": ("GLOO_SOCKET_IFNAME",)}  # fmt: skip


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's parallel layout; one process (and one device) per rank."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @classmethod
    def of(cls, train) -> TrainerLayout:
        """The layout a ``train`` config (:class:`areal_npu.train.config.TrainEngineConfig`) asks
        for: ``dp_size``, and with ``backend: megatron`` its ``megatron.tp_size`` / ``pp_size`` /
        ``cp_size`` (the FSDP2 engine shards over dp alone)."""
        sizes = {"dp": train.dp_size}
        if train.backend == "megatron":
            sizes |= {dim: getattr(train.megatron, f"{dim}_size") for dim in ("tp", "pp", "cp")}
        return cls(**sizes)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def key(self, dim: str) -> str:
        """The recipe key dimension ``dim`` comes from (what errors name)."""
        return TRAINER_KEYS[dim]

    def validate(self) -> None:
        for dim in ("dp", "tp", "pp", "cp"):
            if getattr(self, dim) < 1:
                raise ConfigError(self.key(dim), f"must be >= 1; got {getattr(self, dim)}")

    def size_key(self) -> str:
        """The key to name when the trainer as a whole does not fit: its largest dimension."""
        dims = [d for d in ("dp", "pp", "cp", "tp") if getattr(self, d) > 1]
        return self.key(max(dims, key=lambda d: getattr(self, d))) if dims else self.key("dp")

    def describe(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp} = {self.world_size}"


@dataclass(frozen=True)
class Cluster:
    """The machine(s) to plan for: ``nodes`` alike, each with ``device_ids`` (physical ids: NPUs,
    GPUs, or CPU cores). ``node_addrs`` fill MASTER_ADDR and engine hosts across nodes (else
    placeholders; ``master_addr`` fills node 0's alone); ``source`` says whether it was described
    (flags) or detected."""

    kind: str
    nodes: int = 1
    device_ids: tuple[int, ...] = ()
    node_addrs: tuple[str, ...] = ()
    master_addr: str | None = None  # node 0's alone (the others' come at launch: Ray)
    socket_ifname: str | None = None
    master_port: int = 29500
    hccl_base_port: int = 64000  # the images' HCCL_IF_BASE_PORT (docker/Dockerfile)
    source: str = "described"

    @classmethod
    def uniform(cls, kind: str, nodes: int, devices_per_node: int, **kwargs) -> Cluster:
        return cls(kind, nodes, tuple(range(devices_per_node)), **kwargs)

    @property
    def devices_per_node(self) -> int:
        return len(self.device_ids)

    def validate(self) -> None:
        if self.kind not in plat.DEVICE_TYPES:
            raise ConfigError(
                "--device-kind", f"must be one of {', '.join(plat.DEVICE_TYPES)}; got {self.kind!r}"
            )
        if self.nodes < 1:
            raise ConfigError("--nodes", f"must be >= 1; got {self.nodes}")
        if (
            not self.device_ids
            or len(set(self.device_ids)) != len(self.device_ids)
            or min(self.device_ids) < 0
        ):
            raise ConfigError(
                "--devices-per-node", f"needs distinct device ids >= 0, at least one; got {self.device_ids}"
            )
        if self.node_addrs and len(self.node_addrs) != self.nodes:
            raise ConfigError("node_addrs", f"{len(self.node_addrs)} addresses for {self.nodes} nodes")

    def addr(self, node: int) -> str:
        if self.node_addrs:
            return self.node_addrs[node]
        return self.master_addr if node == 0 and self.master_addr else f"<node{node}>"


@dataclass
class ProcessPlan:
    """One process: where it runs and what it starts with. ``devices`` are its own devices
    (physical ids, or cores); ``rank`` for trainer ranks, ``index`` for engines."""

    name: str
    role: str  # "trainer" | "engine"
    node: int
    devices: list[int]
    env: dict[str, str]
    rank: int | None = None
    index: int | None = None
    tp: int = 1
    host: str | None = None  # engines: the address they listen on
    port: int | None = None  # engines: None = a free port picked at start


@dataclass
class Plan:
    device_kind: str
    nodes: int
    device_ids: list[int]
    trainer: TrainerLayout
    num_engines: int
    engine_tp: int
    processes: list[ProcessPlan]
    weight_transport: dict[str, Any]
    idle: dict[int, list[int]]  # node -> devices nobody got
    shared: bool = False  # CPU only: some cores serve more than one process
    notes: list[str] = field(default_factory=list)

    @property
    def trainers(self) -> list[ProcessPlan]:
        return [p for p in self.processes if p.role == "trainer"]

    @property
    def engines(self) -> list[ProcessPlan]:
        return [p for p in self.processes if p.role == "engine"]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        layout = self.trainer
        out["trainer"] = {d: getattr(layout, d) for d in ("dp", "tp", "pp", "cp")} | {
            "world_size": layout.world_size
        }
        out["idle"] = {str(node): ids for node, ids in self.idle.items()}
        return out
