"""The command line's side of the planner: the cluster from flags or this machine
(:func:`describe_cluster`) and the plan as a table (:func:`render`)."""

from __future__ import annotations

from areal_npu import platform as plat
from areal_npu.config import ConfigError
from areal_npu.placement.model import Cluster, Plan


def describe_cluster(kind: str, nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
    """The cluster from a description (flags), detecting what is not given on this machine through
    the device seam: the CPU's cores from this process's affinity, NPUs / GPUs from the platform."""
    nodes = 1 if nodes is None else nodes
    if devices_per_node is not None:
        return Cluster.uniform(kind, nodes, devices_per_node)
    here = plat.current_platform().device_type
    if kind != "cpu" and here != kind:
        raise ConfigError(
            "--devices-per-node",
            f"this machine has no {kind} devices (it is {here}); describe the target with --devices-per-node",
        )
    try:
        ids = plat.visible_device_ids(kind)
    except ValueError as exc:
        raise ConfigError(
            "--devices-per-node", f"{exc}; describe the devices with --devices-per-node"
        ) from None
    return Cluster(kind, nodes, tuple(ids), source="detected")


def render(result: Plan, console=None) -> None:
    """The plan as one table (process, node, devices, env, role) plus transport, idle devices, notes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: rich's 80 columns would fold every variable
            console = Console(width=160)
    unit = "cores" if result.device_kind == "cpu" else "devices"
    title = (f"placement: {result.nodes} node(s) x {len(result.device_ids)} {result.device_kind} {unit}; "
             f"trainer {result.trainer.describe()} rank(s); {result.num_engines} engine(s) x tp {result.engine_tp}")  # fmt: skip
    table = Table(title=title, show_lines=True)
    for column in ("process", "node", unit, "env", "role"):
        table.add_column(column, overflow="fold")
    for p in result.processes:
        role = p.role + (f" rank {p.rank}" if p.rank is not None else f" tp {p.tp}")
        if p.host is not None:
            role += f" @ {p.host}:{p.port or 'auto'}"
        env = "\n".join(f"{k}={v}" for k, v in p.env.items())
        table.add_row(p.name, str(p.node), plat.format_id_list(p.devices), escape(env), escape(role))
    console.print(table)
    t = result.weight_transport
    line = f"weight transport: {t['name']} (drafter: {t['drafter']})"
    if t["group"]:
        line += f"; group {', '.join(t['group'])} (world size {t['group_world_size']})"
    console.print(escape(line))
    for node, ids in result.idle.items():
        console.print(f"idle on node {node}: {plat.format_id_list(ids)}")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
