"""Placement: which devices every trainer rank and every rollout engine gets, on which node, the
environment each process starts with, and the weight transport between them.

A pure planner: dataclasses in, a :class:`Plan` out; it starts nothing (launchers start processes
from a plan). ``areal-npu train RECIPE --dry-run [--json]`` prints one.

Policy -- trainer first, engines after:

* Trainer ranks fill the nodes in order, node 0 first, one device each, in groups of the trainer's
  tensor-parallel size (Megatron's rank order puts tp innermost, so ranks ``g*tp .. g*tp+tp-1``
  are tp group ``g``): a tp group never spans nodes; a group that does not fit on the rest of a
  node starts on the next one. Context-, pipeline- and data-parallel groups may span nodes.
* Engines follow at the next free devices, each its ``tensor_parallel_size`` devices on one node;
  an engine that does not fit on the rest of a node starts on the next one, and the devices left
  behind stay idle (the plan lists them). When the tp sizes divide the node size this fits every
  layout that fits under these rules at all; with other sizes (tp 3 on 8 devices) another split
  might fit where this one refuses.
* Device sets are disjoint. What does not fit is refused with a ConfigError naming the recipe key
  and the counts (devices needed vs available).
* CPU: the devices are cores. Each process takes one slot (an engine one per tp rank); afterwards
  a node's cores are split as evenly as possible among the processes placed on it, the first ones
  (the trainer ranks) taking the remainder. With more processes than cores the CPU plan shares
  cores (one slot each, round robin) and says so in its notes rather than refusing: small machines
  run the quickstart that way. Accelerator devices are never shared.

Environment, on top of what a process inherits:

* every process: ``AREAL_NPU_DEVICE`` (the device kind, as :func:`platform.use_device` hands down);
* trainer ranks: the visible devices of the trainer ranks on their node (one list per node, as
  torchrun starts a node's ranks with one environment; ``LOCAL_RANK`` picks the rank's own device,
  ``train/dist.py``), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``; on the CPU the rank's own core set;
* engines: the launcher's engine environment (``RolloutConfig.engine_env``), their own devices,
  on the CPU vLLM's OpenMP binding (one core list per tp rank, ``|``-separated) and the core set
  the engine server applies to its whole process group (``env.ENGINE_CPUS_ENV``);
* NPU: each HCCL job on a node (the trainer, each engine) gets its own ``HCCL_IF_BASE_PORT``
  window: a communicator's root takes 32 ports from the base (CANN 9.0), and two jobs on one host
  with the same base fail to bind them (EJ0003);
* several nodes: ``HCCL_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` when
  the cluster names the interface, else a note.

Weight transport: ``weight_transport`` resolved exactly as the rollout config resolves it
(``auto``: hccl on NPU, nccl on CUDA, rpc on the CPU), for the planned device kind. A collective
transport's group is trainer rank 0 (it exports the weights) plus every engine worker. IPC
transports hand over node-local memory handles, so they need every engine on trainer rank 0's node.

Modules: :mod:`.model` (the dataclasses and the recipe keys errors name), :mod:`.env` (the names
of the environment variables the plan writes for its engines), :mod:`.allocate` (the planner:
:func:`plan`, :func:`plan_recipe`), :mod:`.describe` (:func:`describe_cluster`, :func:`render`);
everything public is importable from here.

Starting the processes of a plan (locally, under torchrun, on a Ray cluster) is
:mod:`areal_npu.launch`'s job; nothing here imports it.
"""

from areal_npu.placement.allocate import plan, plan_recipe
from areal_npu.placement.describe import describe_cluster, render
from areal_npu.placement.env import ENGINE_CPUS_ENV, OMP_BIND_ENV
from areal_npu.placement.model import (
    ENGINE_TP_KEY,
    ENGINES_KEY,
    HCCL_MAX_BASE_PORT,
    HCCL_PORT_WINDOW,
    IFNAME_VARS,
    IPC_TRANSPORTS,
    TRAINER_KEYS,
    TRANSPORT_KEY,
    Cluster,
    Plan,
    ProcessPlan,
    TrainerLayout,
)

__all__ = [
    "ENGINE_CPUS_ENV",
    "ENGINES_KEY",
    "ENGINE_TP_KEY",
    "HCCL_MAX_BASE_PORT",
    "HCCL_PORT_WINDOW",
    "IFNAME_VARS",
    "IPC_TRANSPORTS",
    "OMP_BIND_ENV",
    "TRAINER_KEYS",
    "TRANSPORT_KEY",
    "Cluster",
    "Plan",
    "ProcessPlan",
    "TrainerLayout",
    "describe_cluster",
    "plan",
    "plan_recipe",
    "render",
]
