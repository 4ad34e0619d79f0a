"""Trainer rank 0's side of the Ray launcher: its engines go into the bundles the launcher reserved.

Under the Ray launcher rank 0 still starts the engines, at the same point as on one node
(``launch_engines``: after the warm start, from the policy it produced), but not as its own child
processes: ``launch_engines`` (``launch/engines.py``) sees :data:`RAY_ENGINES_ENV` (set by the
launcher for rank 0 only) and calls :func:`launch_ray_engines`, which connects to the launcher's
Ray cluster and starts one :class:`~areal_npu.launch.ray_actors.EngineRunner` actor per planned
engine in that engine's bundle. :class:`RayEngine` gives the client the interface of an
``EngineProcess`` (url, secret, healthy, restart, stop), so the controller, the client's restarts
and the weight sync do not know where the engine runs. The actors belong to rank 0's Ray job:
should rank 0 die, Ray ends them, and each engine's process group dies with its actor.

The run's secret is made here, as ``launch_engines`` makes it, and travels to the actors as a call
argument: never through an environment variable of rank 0, a command line or the run directory.
"""

from __future__ import annotations

import json

from areal_npu.launch.engine_process import EngineStartError
from areal_npu.launch.ray_actors import EngineRunner, report_path

#: Set by the Ray launcher (``ray_launch.py``) for trainer rank 0 only: JSON naming the
#: placement-group bundles its engines go into (:func:`launch_ray_engines` reads it).
RAY_ENGINES_ENV = "AREAL_RAY_ENGINES"
#: Seconds the engine actors get on top of ``startup_timeout_s`` (Ray schedules them first).
SCHEDULE_GRACE_S = 60.0


def actor_options(resources: dict[str, float]) -> dict:
    """``ray.remote(...).options`` for a bundle's resources (CPU / GPU have their own arguments)."""
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), "resources": rest}


class RayEngine:
    """An engine held by a Ray actor, seen through ``EngineProcess``'s interface."""

    def __init__(self, actor, index: int, url: str, secret: str, log: str, report: str):
        self.actor, self.index, self.url, self.secret = actor, index, url, secret
        self.log_path, self.report = log, report
        self.restarts = 0

    def _call(self, method: str, *args, timeout: float | None = 60.0):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return bool(self._call("healthy", timeout_s, timeout=timeout_s + 30))
        except Exception:  # noqa: BLE001 - a dead actor is an unhealthy engine
            return False

    def alive(self) -> bool:
        try:
            return bool(self._call("alive"))
        except Exception:  # noqa: BLE001
            return False

    def restart(self) -> None:
        self.url = self._call("restart", timeout=None)
        self.restarts += 1

    def stop(self, grace_s: float = 10.0) -> None:
        import ray

        try:
            self._call("stop", grace_s, timeout=grace_s + 30)
        except Exception:  # noqa: BLE001 - already gone: Ray ends what is left below
            pass
        ray.kill(self.actor)

    def info(self) -> dict:
        return {"index": self.index, "url": self.url, "ray": True, "log": self.log_path}


def launch_ray_engines(cfg, spec: dict) -> list[RayEngine]:
    """Start ``cfg.num_engines`` engines as actors in the bundles ``spec`` names (the launcher's
    :data:`RAY_ENGINES_ENV` JSON: address, namespace, kind, report_dir, and per engine its
    placement group, bundle, resources, environment, host). All start at once; any failure stops
    them all and raises ``EngineStartError`` with the failing engine's log tail."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from areal_npu.rollout import guard

    planned = spec["engines"]
    if len(planned) != cfg.num_engines:
        raise ValueError(
            f"{RAY_ENGINES_ENV} places {len(planned)} engines; rollout.num_engines is {cfg.num_engines}"
        )
    if not ray.is_initialized():
        ray.init(address=spec["address"], namespace=spec["namespace"], log_to_driver=False)
    secret = guard.make_secret()
    runner = ray.remote(EngineRunner)
    actors = []
    for i, engine in enumerate(planned):
        group = ray.util.get_placement_group(engine["group"])
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=engine["bundle"])
        options = actor_options(engine["resources"]) | {"scheduling_strategy": strategy, "max_restarts": 0}
        actors.append(
            runner.options(**options).remote(
                engine["process"],
                cfg.to_json(),
                i,
                engine["env"],
                spec["kind"],
                secret,
                spec["report_dir"],
                engine["host"],
            )
        )
    started = [actor.start.remote() for actor in actors]
    reports = []
    try:
        for i, ref in enumerate(started):
            try:
                reports.append(ray.get(ref, timeout=cfg.startup_timeout_s + SCHEDULE_GRACE_S))
            except Exception as exc:  # the actor's EngineStartError carries the engine's log tail
                raise EngineStartError(
                    f"engine {i} (Ray actor in bundle {planned[i]['bundle']} of {planned[i]['group']}) did not "
                    f"start: {type(exc).__name__}: {exc}"
                ) from None
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return [
        RayEngine(
            actor,
            i,
            rep["url"],
            secret,
            rep["log"],
            str(report_path(spec["report_dir"], planned[i]["process"])),
        )
        for i, (actor, rep) in enumerate(zip(actors, reports))
    ]


def spec_json(spec: dict) -> str:
    return json.dumps(spec, separators=(",", ":"))
