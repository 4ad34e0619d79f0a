"""The rollout engine process: vLLM's AsyncLLM behind vLLM's own OpenAI app plus our token API.

Run as ``python -m areal_npu.rollout.server --config CONFIG.json --port PORT`` (the launcher,
``areal_npu.launch``, does). vLLM's app supplies ``/health``, ``/metrics`` (Prometheus) and the
OpenAI routes (``/v1/...``) for agent frameworks; this process adds, under ``/areal``:

* ``POST /areal/generate``, ``/areal/pause``, ``/areal/resume`` (``generation_routes.py``) -- token
  ids in; per sample: generated ids, behaviour log-prob of every sampled token (``RolloutConfig.logprobs_mode``),
  the weight version of every token, finish reason, and the request's speculative-decoding summary
  (null where vLLM has no per-request metrics: 0.23). Pausing is ``keep`` mode: in-flight requests
  freeze and continue after resume (their later tokens carry the new version).
* ``POST /areal/update_weights/{begin,bucket,commit,abort}`` and
  ``/areal/update_weights/collective/{init,bucket}`` (``weight_routes.py``) -- one versioned update
  of the policy and the MTP drafter, by RPC buckets staged until a complete commit, or by the
  hccl / nccl / gloo broadcast; an engine never serves a version it got part of.
* ``POST /areal/spec_k`` and ``GET /areal/metrics`` (``spec_routes.py``) -- the draft length of an
  engine started with ``spec.adaptive`` (:mod:`areal_npu.speculation.k_driver`), and the cumulative
  acceptance counters as JSON (on every vLLM version).
* ``GET /areal/version`` -- weight version, update state, draft length, and the vLLM version and
  feature map (``EngineState.status`` in ``engine_state.py``).

An engine that returns raw log-probs (speculation on, or vLLM < 0.32) refuses sampling that would
make them wrong as behaviour log-probs (400 naming the field; ``raw_sampling.py``): on
``/areal/generate``, and on vLLM's routes when a request asks for log-probs.

Every route but ``GET /health`` needs the run's secret (``guard.py``: 401 without it, before the
body is read) and takes a bounded body (413 past it). Every body is checked against its route's
fields (``request_body.py``) before the engine is touched: a missing, wrong-typed or unknown field
answers 400 naming the field (``route_errors.py``).
"""

import argparse
import contextlib
import json
import os

from fastapi import APIRouter

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.placement.env import ENGINE_CPUS_ENV
from areal_npu.rollout import generation_routes, guard, raw_sampling, spec_routes, weight_routes
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.engine_state import EngineState
from areal_npu.rollout.parent_watch import die_with_parent
from areal_npu.speculation import k_driver


def make_router(state: EngineState) -> APIRouter:
    """Every ``/areal`` route of one engine, on one router (registered here, not included: the
    guard and the route tests see them all at its top level)."""
    router = APIRouter(prefix="/areal")
    generation_routes.add_routes(router, state)

    @router.get("/version")
    async def version():
        return state.status()

    spec_routes.add_routes(router, state)
    weight_routes.add_routes(router, state)
    return router


def _vllm_server_parts():
    """vLLM's OpenAI-server building blocks: 0.32 keeps them in ``vllm.entrypoints.launchers``,
    0.23 in ``vllm.entrypoints.openai.api_server`` (same functions; ``setup_server`` gained
    ``reuse_port``)."""
    from types import SimpleNamespace

    if vllm_version.has("entrypoints_launchers"):
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.launcher import serve_http
        from vllm.entrypoints.launchers.launcher import setup_server as _setup

        def setup_server(args):
            return _setup(args, reuse_port=False)

    else:
        from vllm.entrypoints.launcher import serve_http
        from vllm.entrypoints.openai.api_server import (
            build_app,
            build_async_engine_client,
            init_app_state,
            setup_server,
        )
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    return SimpleNamespace(
        init_app_state=init_app_state,
        build_async_engine_client=build_async_engine_client,
        build_app=build_app,
        make_arg_parser=make_arg_parser,
        validate_parsed_serve_args=validate_parsed_serve_args,
        serve_http=serve_http,
        setup_server=setup_server,
    )


async def serve(cfg: RolloutConfig, port: int, secret: str) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not vllm_version.has("pause_keep"):  # the update routes freeze in-flight requests
        raise RuntimeError(
            f"vLLM {vllm_version.installed_version()} has no pause_generation(mode='keep'); "
            f"needs >= {vllm_version.since_text('pause_keep')}"
        )
    vllm_api = _vllm_server_parts()
    argv = cfg.vllm_cli_args(port)
    with contextlib.ExitStack() as scope:
        if cfg.spec.adaptive:  # before vLLM starts: its engine-core process inherits the environment
            scope.enter_context(k_driver.control_file(cfg.spec.k_at_start, cfg.spec.off_keeps_drafter_kv))
        args = vllm_api.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        vllm_api.validate_parsed_serve_args(args)
        listen_address, sock = vllm_api.setup_server(args)
        async with vllm_api.build_async_engine_client(args) as engine:
            supported = await engine.get_supported_tasks()
            app = vllm_api.build_app(args, supported, engine.model_config)
            await vllm_api.init_app_state(engine, app.state, args, supported)
            app.include_router(make_router(EngineState(engine, cfg)))
            # vLLM-Ascend leaves an eagle3 drafter its own, unloaded output head (inplace_reload.py)
            if cfg.spec.method == "eagle3":
                await engine.collective_rpc("areal_tie_draft_head")
            why = raw_sampling.why_raw(cfg)
            if why is not None:  # vLLM's routes, asked for log-probs of a transformed distribution: 400
                raw_sampling.install(app, why, engine.model_config.get_diff_sampling_param())
            # outermost: the secret and body limits before any of vLLM's middleware or routes
            limits = guard.body_limits(cfg.weight_bucket_bytes, cfg.max_model_len, cfg.model)
            guard.install(app, secret, limits)
            shutdown_task = await vllm_api.serve_http(
                app,
                sock=sock,
                host=args.host,
                port=args.port,
                log_level="warning",
                access_log=False,
            )
        try:
            await shutdown_task
        finally:
            sock.close()


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    parser = argparse.ArgumentParser(description="areal-npu rollout engine (vLLM)")
    parser.add_argument("--config", required=True, help="RolloutConfig as a JSON file or JSON string")
    parser.add_argument("--port", type=int, required=True)
    ns = parser.parse_args(argv)
    # taken out of the environment at once: vLLM's own processes, started below, do not inherit it
    secret = os.environ.pop(guard.SECRET_ENV, "")
    if not secret:
        raise SystemExit(
            f"{guard.SECRET_ENV} is not set: the launcher hands every engine its run's secret through the "
            "environment, and an engine does not serve without one"
        )
    text = open(ns.config).read() if os.path.isfile(ns.config) else ns.config
    cfg = RolloutConfig.from_dict(json.loads(text))
    cfg.spec.validate()  # resolves an adaptive spec's settings in this process (the JSON holds the dict)
    for key, value in cfg.engine_env().items():
        os.environ.setdefault(key, value)
    cpus = os.environ.get(ENGINE_CPUS_ENV)
    if cpus:  # the launcher's core slice (areal_npu/launch/cpu_binding.py); vLLM's processes inherit it
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    import uvloop

    uvloop.run(serve(cfg, ns.port, secret))


if __name__ == "__main__":
    main()
