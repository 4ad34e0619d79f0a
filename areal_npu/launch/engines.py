"""``launch_engines``: a run's rollout engines, started here or, under the Ray launcher, in the
bundles it reserved.

The one entry the trainer calls (``run.py``, after the warm start). It picks the starter from the
environment: trainer rank 0 of a Ray launch finds :data:`~areal_npu.launch.ray_engines.RAY_ENGINES_ENV`
and hands the engines to Ray (:func:`~areal_npu.launch.ray_engines.launch_ray_engines`); every other
run starts :class:`~areal_npu.launch.engine_process.EngineProcess` children of this process. Both
starters sit below this module, and neither imports it.
"""

from __future__ import annotations

import json
import os

from areal_npu.launch.engine_process import EngineProcess, install_stop_handlers
from areal_npu.launch.ray_engines import RAY_ENGINES_ENV, launch_ray_engines
from areal_npu.rollout import guard
from areal_npu.rollout.config import RolloutConfig


def launch_engines(cfg: RolloutConfig, hosts: list[str] | None = None) -> list[EngineProcess]:
    """Validate, then start ``cfg.num_engines`` engines concurrently, with one new secret for the
    run; returns once all are healthy (any failure stops them all and raises). ``hosts``: the
    address each engine listens on (the plan's), else ``cfg.host``."""
    cfg.validate()
    if not cfg.model:
        raise ValueError("model must name a checkpoint directory")
    if hosts is not None and len(hosts) != cfg.num_engines:
        raise ValueError(f"{len(hosts)} hosts for {cfg.num_engines} engines")
    placed = ray_placed_engines(cfg)
    if placed is not None:
        return placed
    from concurrent.futures import ThreadPoolExecutor

    install_stop_handlers()  # from the main thread, before the start-up threads
    secret = guard.make_secret()
    engines = [
        EngineProcess(cfg, index=i, host=hosts[i] if hosts else None, secret=secret)
        for i in range(cfg.num_engines)
    ]
    try:
        # all at once: start-up is mostly imports and model loading, each in its own processes
        with ThreadPoolExecutor(max_workers=cfg.num_engines) as pool:
            for future in [pool.submit(engine.start) for engine in engines]:
                future.result()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


def ray_placed_engines(cfg: RolloutConfig) -> list | None:
    """Under the Ray launcher, the engines started as Ray actors in the bundles it reserved
    (objects with ``EngineProcess``'s interface); None when this process was not started by it."""
    spec = os.environ.get(RAY_ENGINES_ENV)
    if not spec:
        return None
    return launch_ray_engines(cfg, json.loads(spec))


def describe(engines: list[EngineProcess]) -> str:
    return json.dumps([e.info() for e in engines])
