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


def collapse(processes) -> tuple[dict[str, str], list[str]]:
    """The environment all ``processes`` share, and the names of the variables that differ."""
    common = dict(processes[0].env)
    for p in processes[1:]:
        common = {k: v for k, v in common.items() if p.env.get(k) == v}
    varying = [k for k in dict.fromkeys(k for p in processes for k in p.env) if k not in common]
    return common, varying


def _span(values: list[str]) -> str:
    return values[0] if len(set(values)) == 1 else f"{values[0]}..{values[-1]}"


def role_rows(result: Plan) -> list[dict[str, str]]:
    """One row per role (trainer, engines): count, nodes, devices, shared and varying environment."""
    rows = []
    for role, group in (("trainer", result.trainers), ("engine", result.engines)):
        if not group:
            continue
        common, varying = collapse(group)
        nodes = sorted({p.node for p in group})
        if role == "trainer":
            count = f"{len(group)} rank(s)"
            devices = "; ".join(f"node {n}: {plat.format_id_list([d for p in group if p.node == n for d in p.devices])}"
                                for n in nodes)  # fmt: skip
        else:
            count = f"{len(group)} x tp {group[0].tp}"
            devices = ", ".join(plat.format_id_list(p.devices) for p in group)
            hosts = sorted({f"{p.host}:{p.port or 'auto'}" for p in group})
            common = {"listen": ", ".join(hosts), **common}
        vary = ", ".join(f"{k} ({_span([p.env[k] for p in group if k in p.env])})" for k in varying)
        rows.append({"role": role, "count": count, "nodes": ", ".join(map(str, nodes)), "devices": devices,
                     "env": " ".join(f"{k}={v}" for k, v in common.items()), "per process": vary})  # fmt: skip
    return rows


def render(result: Plan, console=None, verbose: bool = False) -> None:
    """The plan: one row per role (``verbose``: one table row per process with its whole
    environment) plus transport, idle devices, notes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: rich's 80 columns would fold every variable
            console = Console(width=160)
    if not verbose:
        table = Table(show_lines=True, title="processes (--verbose: every process's environment)")
        for column in ("role", "count", "nodes", "devices", "env", "per process"):
            table.add_column(column, overflow="fold")
        for row in role_rows(result):
            table.add_row(*(escape(v) for v in row.values()))
        console.print(table)
        _tail(result, console)
        return
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
    _tail(result, console)


def _tail(result: Plan, console) -> None:
    from rich.markup import escape

    t = result.weight_transport
    line = f"weight transport: {t['name']} (drafter: {t['drafter']})"
    if t["group"]:
        members = (
            t["group"] if len(t["group"]) <= 3 else [t["group"][0], f"{t['group'][1]}..{t['group'][-1]}"]
        )
        line += f"; group {', '.join(members)} (world size {t['group_world_size']})"
    console.print(escape(line))
    for node, ids in result.idle.items():
        console.print(f"idle on node {node}: {plat.format_id_list(ids)}")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
