"""``areal-npu train RECIPE --dry-run``: the placement plan and its estimates, summary first.

Default output: a summary (placement, memory budget with its reserve and fraction of the device,
step time with its source and assumptions), one row per role, the notes. ``--verbose`` adds every
process's environment, the memory terms, the step model's k sweep and the Ray placement groups.
A plan whose memory budget is above ``train.max_memory_fraction`` is printed, then refused with
exit code 2 and what to change (``Estimates.refusal``). Nothing is started, nothing written.
"""

from __future__ import annotations

import json
import sys

from areal_npu import placement, step_estimate

EXIT_REFUSED = 2


def summary_lines(cfg, plan, est, launcher: str) -> list[str]:
    """The summary: placement, addresses, memory, step time (each one or two lines)."""
    chip = step_estimate.ASCEND_CHIPS.get(len(plan.device_ids)) if plan.device_kind == "npu" else None
    where = f"{plan.nodes} {chip + ' ' if chip else ''}node(s) x {len(plan.device_ids)} {plan.device_kind} devices"
    by_node = {}
    for p in plan.processes:
        by_node.setdefault(p.node, []).append(p)
    roles = []
    for node, procs in sorted(by_node.items()):
        t = sum(p.role == "trainer" for p in procs)
        e = sum(p.role == "engine" for p in procs)
        parts = ([f"{t} trainer rank(s)"] if t else []) + (
            [f"{e} engine(s) x tp {plan.engine_tp}"] if e else []
        )
        roles.append(f"node {node} {procs[0].host or ''}".rstrip() + ": " + " + ".join(parts))
    lines = [f"placement: {where}, launcher {launcher}; trainer {cfg.train.backend} {plan.trainer.describe()} ranks; "
             f"{plan.num_engines} engine(s) x tp {plan.engine_tp}; weight sync {plan.weight_transport['name']}"]  # fmt: skip
    lines.append("  " + "; ".join(roles))
    trainer0 = plan.trainers[0].env
    if "MASTER_ADDR" in trainer0:
        head = f"; Ray head on node 0 ({_node0(plan)})" if launcher == "ray" and plan.nodes > 1 else ""
        lines.append(f"  trainer rendezvous MASTER_ADDR={trainer0['MASTER_ADDR']} MASTER_PORT={trainer0['MASTER_PORT']}"
                     f"{' (all ranks on one node)' if trainer0['MASTER_ADDR'] == '127.0.0.1' else ''}{head}")  # fmt: skip
    if est.budget is not None:
        lines.append("memory: " + step_estimate.memory_line(est))
        model = f"model shape from {est.model['source']} ({est.model['parameters'] / 1e9:.2f} B parameters)"
        lines.append("  " + "; ".join([model, *est.budget.assumptions]))
    if est.step is not None:
        s, info = est.step, est.step_time
        spec = (
            f" = {s.t_gen_ar:.0f} autoregressive / {s.gen_speedup:.2f}x speculation"
            if s.gen_speedup != 1
            else ""
        )
        lines.append(f"step time: ~{s.t_step:.0f} s per step (rollout {s.t_gen:.0f}{spec}, train {s.t_train:.0f}, "
                     f"sync {s.t_sync:.0f}); from per-token costs of the {info['source']}")  # fmt: skip
        lines += [f"  assumed: {a}" for a in info["assumptions"]]
    return lines


def _node0(plan) -> str:
    engines_home = [p.host for p in plan.engines if p.node == 0 and p.host]
    return engines_home[0] if engines_home else plan.weight_transport.get("sender_addr") or "<node0>"


def launcher_notes(plan, launcher: str) -> list[str]:
    if launcher == "local" and plan.nodes > 1:
        return ["--launcher local starts one node only (torchrun on this machine): a plan over several nodes "
                "runs with --launcher ray (the recipe scripts' LAUNCHER=ray)"]  # fmt: skip
    return []


def run(args, cfg) -> int:
    """Plan ``cfg`` as ``args`` describe, print it, and return the exit code (2: refused)."""
    from rich.console import Console
    from rich.markup import escape

    kind = args.device_kind or cfg.device
    cluster = placement.describe_cluster(kind, args.nodes, args.devices_per_node)
    if args.master_addr:
        import dataclasses

        cluster = dataclasses.replace(cluster, master_addr=args.master_addr)
    plan = placement.plan_recipe(cfg, cluster)
    plan.notes += launcher_notes(plan, args.launcher)
    est = step_estimate.dry_run_estimates(cfg, plan, args.model_config)
    groups = _ray_groups(plan) if args.launcher == "ray" else None
    if args.json:
        ray_part = {"ray_placement_groups": groups} if groups is not None else {}
        summary = {"summary": summary_lines(cfg, plan, est, args.launcher), "launcher": args.launcher}
        print(json.dumps(summary | plan.to_dict() | {"estimates": est.to_dict()} | ray_part, indent=2))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=160)
        for line in summary_lines(cfg, plan, est, args.launcher):
            console.print(escape(line), highlight=False, soft_wrap=True)
        placement.render(plan, console, verbose=args.verbose)
        if args.verbose:
            _verbose(est, groups, console)
        for note in est.notes:
            console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    if est.refusal:
        print(f"areal-npu train --dry-run: refused: {est.refusal}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _verbose(est, groups, console) -> None:
    from rich.markup import escape

    from areal_npu.memory_budget import format_budget
    from areal_npu.memory_model import format_memory_table

    if est.memory_estimate is not None:
        console.print(escape(format_memory_table(est.memory_estimate)), highlight=False)
        for line in format_budget(est.budget):
            console.print(escape(line), highlight=False)
    if est.step_plan is not None:
        from areal_npu.speculation import step_plan

        console.print(f"step model (reproduce: {escape(est.step_time['command'])}):", highlight=False)
        step_plan.render(est.step_plan)
    if groups is not None:
        console.print("Ray placement groups (STRICT_PACK, one bundle per process):")
        for node, bundles in enumerate(groups):
            console.print(f"  node {node}: {json.dumps(bundles)}", highlight=False)


def _ray_groups(plan) -> list:
    """The placement groups the Ray launcher would ask Ray for (pure: Ray is not imported)."""
    from areal_npu.launch.ray_bundles import placement_groups

    return placement_groups(plan)
