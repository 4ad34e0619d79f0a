"""The Ray launcher: one run's trainer ranks and rollout engines placed on a Ray cluster.

    python -m areal_npu.launch.ray_launch RECIPE [key=value ...] [--address ADDR | --local-cpus N] [--resume]
    areal-npu train RECIPE [key=value ...] --launcher ray [--ray-address ADDR] [--resume]

Ray is the cluster manager: the recipe's shell script starts the head and the workers
(``ray start --head`` / ``ray start --address``), or an existing cluster is used (``--address``,
else ``RAY_ADDRESS``); ``--local-cpus N`` starts a one-node cluster for this run alone (tests,
laptops). The launcher

1. describes the cluster from ``ray.nodes()`` (``ray_bundles.cluster_from_ray``) and plans the
   recipe on it (``placement.plan_recipe``: the same plan ``--dry-run`` prints);
2. reserves one placement group per plan node, one bundle per process, with the device seam's
   resource names (``ray_bundles``), each group pinned to its plan node's Ray node (the ranks' MASTER_ADDR
   is node 0's), and waits until Ray grants them (or stops, naming the demand);
3. starts every trainer rank as an actor in its bundle (``ray_actors.ProcessRunner``) running
   ``python -m areal_npu.cli train RECIPE ...`` with the plan's environment -- torchrun's variables
   (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a rank behaves
   as one torchrun started; rank 0 also gets the engines' bundles (``ray_engines.RAY_ENGINES_ENV``)
   and starts the engines there when it reaches ``launch_engines`` (``ray_engines``);
4. waits: all ranks exit 0 -> exit 0; a rank fails or an actor dies -> everything stops and the
   launcher exits 1 with the failing rank's log tail; Ctrl-C / SIGTERM -> everything stops, 130.

Every exit path stops the ranks (SIGTERM to their sessions, SIGKILL after a grace), kills the
actors and removes the placement groups; rank 0's Ray job owns the engine actors, so they end with
it. Logs and per-process reports (``ray_actors.write_report``) go to ``RUN_DIR/ray/``; across
nodes the run directory must be on a shared filesystem (the engines load rank 0's policy from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from areal_npu.config import ConfigError
from areal_npu.launch.engine_process import free_port
from areal_npu.launch.ray_actors import ProcessRunner
from areal_npu.launch.ray_bundles import cluster_from_ray, placement_groups, placements
from areal_npu.launch.ray_engines import RAY_ENGINES_ENV, actor_options, spec_json

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
NAMESPACE = "areal-npu"


class Interrupted(Exception):
    """SIGTERM / SIGINT while the run was up."""


def _raise_interrupted(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def engine_spec(plan, spots, group_names, address: str, report_dir: str) -> dict:
    """What rank 0 needs to start the plan's engines in their bundles (``ray_engines``)."""
    by_name = {s.process: s for s in spots}
    engines = []
    for p in plan.engines:
        spot = by_name[p.name]
        host = None if plan.nodes > 1 else p.host  # several nodes: the Ray node's own address
        engines.append({"process": p.name, "group": group_names[spot.group], "bundle": spot.bundle,
                        "resources": spot.resources, "env": p.env, "host": host})  # fmt: skip
    return {"address": address, "namespace": NAMESPACE, "kind": plan.device_kind, "report_dir": report_dir,
            "engines": engines}  # fmt: skip


class RayRun:
    """One run's placement groups and trainer actors; :meth:`run` returns the exit code."""

    def __init__(self, cfg, plan, train_argv: list[str], run_dir: Path, ready_timeout_s: float = 300.0,
                 node_addrs: tuple[str, ...] = ()):  # fmt: skip
        self.cfg, self.plan, self.train_argv, self.node_addrs = cfg, plan, train_argv, node_addrs
        self.run_dir, self.ready_timeout_s = run_dir, ready_timeout_s
        self.report_dir = run_dir / "ray"
        self.groups, self.actors = [], {}  # process name -> actor

    def _reserve(self, tag: str):
        import ray
        from ray.util.placement_group import placement_group

        bundles = placement_groups(self.plan, self.node_addrs)
        names = [f"areal-{tag}-node{i}" for i in range(len(bundles))]
        self.groups = [placement_group(b, strategy="STRICT_PACK", name=n) for b, n in zip(bundles, names)]
        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups),
                            timeout=self.ready_timeout_s)  # fmt: skip
        if len(ready) < len(self.groups):
            raise ConfigError(
                "rollout.num_engines",
                f"the Ray cluster did not grant the plan's placement groups within {self.ready_timeout_s:.0f} s: "
                f"asked for {bundles} (one group per node); it has {ray.available_resources()} free",
            )
        groups = [{"name": n, "id": g.id.hex(), "node": i, "bundles": b}
                  for i, (n, g, b) in enumerate(zip(names, self.groups, bundles))]  # fmt: skip
        (self.report_dir / "groups.json").write_text(json.dumps(groups, indent=1))
        return names

    def _start_trainers(self, spots, names, address: str) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        by_name = {s.process: s for s in spots}
        runner = ray.remote(ProcessRunner)
        engines = spec_json(engine_spec(self.plan, spots, names, address, str(self.report_dir)))
        for p in self.plan.trainers:
            spot = by_name[p.name]
            env = dict(p.env)
            if p.rank == 0:
                env[RAY_ENGINES_ENV] = engines
            strategy = PlacementGroupSchedulingStrategy(
                self.groups[spot.group], placement_group_bundle_index=spot.bundle
            )
            log = self.report_dir / (p.name.replace("/", "-") + ".log")
            self.actors[p.name] = runner.options(
                **actor_options(spot.resources), scheduling_strategy=strategy, max_restarts=0
            ).remote(
                p.name,
                self.train_argv,
                env,
                self.plan.device_kind,
                str(log),
                str(self.report_dir),
                os.getcwd(),
            )
        ray.get([actor.start.remote() for actor in self.actors.values()], timeout=self.ready_timeout_s)

    def _wait(self) -> int:
        import ray

        pending = dict(self.actors)
        while pending:
            for name, actor in list(pending.items()):
                try:
                    code = ray.get(actor.poll.remote(), timeout=60)
                except ray.exceptions.RayError as exc:
                    print(f"ray_launch: the actor of {name} failed: {exc}", file=sys.stderr)
                    return EXIT_FAILED
                if code is None:
                    continue
                del pending[name]
                if code != 0:
                    log_tail = ray.get(actor.log_tail.remote())
                    print(
                        f"ray_launch: {name} exited with code {code}; its log ends:\n{log_tail}",
                        file=sys.stderr,
                    )
                    return EXIT_FAILED
            time.sleep(1.0)
        return 0

    def _teardown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        stops = []
        for actor in self.actors.values():
            try:
                stops.append(actor.stop.remote(10.0))
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to stop
                pass
        try:
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=40)
        finally:
            for actor in self.actors.values():
                ray.kill(actor)
            for group in self.groups:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass

    def run(self) -> int:
        import ray

        self.report_dir.mkdir(parents=True, exist_ok=True)
        previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            names = self._reserve(uuid.uuid4().hex[:8])
            self._start_trainers(placements(self.plan), names, ray.get_runtime_context().gcs_address)
            return self._wait()
        except Interrupted as exc:
            print(f"ray_launch: {exc}: stopping the run", file=sys.stderr)
            return EXIT_INTERRUPTED
        except ray.exceptions.RayError as exc:  # an actor that could not start, a lost node
            print(f"ray_launch: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the teardown short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self._teardown()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m areal_npu.launch.ray_launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--address", help="an existing Ray cluster (default: RAY_ADDRESS, else 'auto')")
    where.add_argument("--local-cpus", type=int, help="start a one-node Ray cluster with N CPUs for this run")
    parser.add_argument("--resume", action="store_true", help="every rank continues from the last checkpoint")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0,
                        help="how long to wait for Ray to grant the placement groups")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import ray

    from areal_npu.config import load_config
    from areal_npu.placement import plan_recipe
    from areal_npu.recipe import RLConfig

    try:
        cfg = load_config(RLConfig, args.recipe, args.overrides)
        if args.local_cpus is not None and args.local_cpus < 1:
            raise ConfigError("--local-cpus", f"must be >= 1; got {args.local_cpus}")
    except ConfigError as exc:
        print(f"ray_launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    init = {"namespace": NAMESPACE, "log_to_driver": False, "include_dashboard": False}
    if args.local_cpus is not None:
        ray.init(num_cpus=args.local_cpus, **init)
    else:
        ray.init(address=args.address or os.environ.get("RAY_ADDRESS") or "auto", **init)
    try:
        cluster = cluster_from_ray(cfg.device, ray.nodes(), sorted(os.sched_getaffinity(0)))
        if cluster.nodes == 1:  # the rendezvous on this node: any free port, not a fixed one
            cluster = dataclasses.replace(cluster, master_port=free_port())
        plan = plan_recipe(cfg, cluster)
        train_argv = [sys.executable, "-m", "areal_npu.cli", "train", str(Path(args.recipe).resolve()),
                      *args.overrides, *(["--resume"] if args.resume else [])]  # fmt: skip
        run = RayRun(
            cfg, plan, train_argv, Path(cfg.run_dir).resolve(), args.ready_timeout_s, cluster.node_addrs
        )
        return run.run()
    except (ConfigError, ValueError) as exc:
        print(f"ray_launch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
