"""The rollout engine process: vLLM's AsyncLLM behind vLLM's own OpenAI app plus our token API.

Run as ``python -m areal_npu.rollout.server --config CONFIG.json --port PORT`` (the launcher does).
vLLM's app supplies ``/health``, ``/metrics`` (Prometheus) and the OpenAI routes (``/v1/...``) for
agent frameworks; this module adds, under ``/areal``:

* ``POST /areal/generate`` -- token ids in; per sample: generated ids, behaviour log-prob of every
  sampled token (``raw_logprobs``), the weight version of every token, finish reason, and the
  request's speculative-decoding summary (null where vLLM has no per-request metrics: 0.23;
  the engine counters under ``/areal/metrics`` carry acceptance on every version).
* ``POST /areal/pause``, ``/areal/resume`` -- generation paused in ``keep`` mode: in-flight
  requests freeze and continue after resume (their later tokens carry the new version).
* ``POST /areal/update_weights/{begin,bucket,commit}`` -- bucketed in-place update of the policy
  and the MTP drafter through ``collective_rpc`` (see ``worker_ext.py``); generation is paused
  from ``begin`` to ``commit``, and ``commit`` sets the new version.
* ``POST /areal/update_weights/collective/{init,start,chunk,finish}`` -- vLLM's weight-transfer
  engines (NCCL / CUDA IPC, and vLLM-Ascend's HCCL / NPU IPC) for device-to-device updates.
* ``POST /areal/spec_k`` -- ``{"k": K}``: draft length from the next scheduler step on (engines
  started with ``spec.adaptive``; 0 = no drafts; see :mod:`areal_npu.spec.k_driver`).
* ``GET /areal/metrics`` (cumulative acceptance counters as JSON), ``GET /areal/version`` (weight
  version, and the vLLM version and feature map: ``vllm_features.py``).

Every body is checked against its route's fields (``request_body.py``) before the engine is
touched: a missing, wrong-typed or unknown field answers 400 naming the field.
"""

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from areal_npu.rollout import request_body, vllm_features
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.parent_watch import die_with_parent
from areal_npu.spec import k_driver

TRANSFER_BACKENDS = {"nccl": "nccl", "cuda_ipc": "ipc", "hccl": "hccl", "npu_ipc": "npu_ipc"}


class EngineState:
    """Weight version and update session shared by the routes of one engine."""

    def __init__(self, engine, cfg: RolloutConfig):
        self.engine = engine
        self.cfg = cfg
        self.version = 0
        self.updating = False
        self.active_target: str | None = None
        self.loaded: dict[str, int] = {}
        self.update_started = 0.0
        self.lock = asyncio.Lock()
        self.started = time.time()
        self.failed_update: str | None = None
        self.spec_k_file: str | None = os.environ.get(k_driver.ENV_FILE)
        self.spec_k = cfg.spec.adapt_config().k_init if cfg.spec.adaptive else cfg.spec.num_speculative_tokens
        # vLLM fills CompletionOutput.spec_decode_metrics only where it has the flag (vllm_features)
        self.per_request_spec = cfg.spec.enabled and vllm_features.has("per_request_spec_metrics")

    async def rpc(self, method: str, *args) -> list:
        return await self.engine.collective_rpc(method, args=args)

    async def switch_target(self, target: str | None) -> None:
        if self.active_target == target:
            return
        if self.active_target is not None:
            counts = await self.rpc("areal_finish_update", self.active_target)
            self.loaded[self.active_target] = int(counts[0])
        self.active_target = target
        if target is not None:
            await self.rpc("areal_begin_update", target)


def checked_top_k(body: dict[str, Any], cfg: RolloutConfig) -> int:
    """The request's top-k (0: none), refused together with speculation (a validated ``body``)."""
    top_k = cfg.top_k if body["top_k"] is None else body["top_k"]
    if cfg.spec.enabled and top_k > 0:
        raise request_body.BodyError(
            "top_k", f"= {top_k} with speculative decoding ({cfg.spec.method}) crashes vLLM 0.32; use top_p"
        )
    return max(top_k, 0)


def _sampling_params(body: dict[str, Any], top_k: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=body["n"],
        temperature=float(body["temperature"]),
        top_p=float(body["top_p"]),
        top_k=top_k,
        max_tokens=body["max_tokens"],
        stop_token_ids=body["stop_token_ids"] or [],
        ignore_eos=body["ignore_eos"],
        seed=body["seed"],
        logprobs=0,  # the sampled token's own log-prob
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def make_router(state: EngineState):
    router = APIRouter(prefix="/areal")

    @router.post("/generate")
    async def generate(request: Request):
        body = await _body(request, request_body.GENERATE)
        refused = _vllm_client_errors()
        try:
            params = _sampling_params(body, _checked(lambda: checked_top_k(body, state.cfg)))
        except refused as exc:
            raise _refused_by_vllm(exc) from None
        input_ids = body["input_ids"]
        request_id = body["request_id"] or uuid.uuid4().hex
        samples = [
            {"output_ids": [], "logprobs": [], "versions": [], "finish_reason": None, "spec": None}
            for _ in range(params.n)
        ]
        try:
            async for out in state.engine.generate({"prompt_token_ids": input_ids}, params, request_id):
                version = state.version
                for comp in out.outputs:
                    sample = samples[comp.index]
                    ids = list(comp.token_ids)
                    sample["output_ids"] += ids
                    if comp.logprobs:
                        sample["logprobs"] += [
                            step[tok].logprob for step, tok in zip(comp.logprobs, ids, strict=True)
                        ]
                    sample["versions"] += [version] * len(ids)
                    if comp.finish_reason is not None:
                        sample["finish_reason"] = comp.finish_reason
                    metrics = comp.spec_decode_metrics if state.per_request_spec else None
                    if metrics is not None:
                        sample["spec"] = metrics.to_dict() if hasattr(metrics, "to_dict") else metrics
        except asyncio.CancelledError:
            await state.engine.abort(request_id)
            raise
        except refused as exc:  # e.g. a prompt longer than max_model_len: the same on any engine
            raise _refused_by_vllm(exc) from None
        return {"request_id": request_id, "prompt_len": len(input_ids), "samples": samples}

    @router.post("/pause")
    async def pause(request: Request):
        body = await _body(request, request_body.PAUSE)
        await state.engine.pause_generation(mode=body["mode"], clear_cache=False)
        return {"paused": True}

    @router.post("/resume")
    async def resume(request: Request):
        await _body(request, request_body.NOTHING)
        await state.engine.resume_generation()
        return {"paused": False}

    @router.get("/version")
    async def version():
        return {
            "version": state.version,
            "updating": state.updating,
            "failed_update": state.failed_update,
            "pid": os.getpid(),
            "spec": state.cfg.spec.vllm_dict(),
            "spec_k": state.spec_k,
            "uptime_s": time.time() - state.started,
            "vllm": vllm_features.summary(),
        }

    @router.post("/spec_k")
    async def set_spec_k(request: Request):
        if not state.cfg.spec.adaptive or state.spec_k_file is None:
            raise HTTPException(status_code=400, detail="this engine was not started with spec.adaptive")
        body = await _body(request, request_body.spec_k_fields(state.cfg.spec.num_speculative_tokens))
        k = body["k"]
        k_driver.write_k(state.spec_k_file, k)
        state.spec_k = k
        return {"k": k}

    @router.get("/metrics")
    async def metrics():
        from vllm.v1.metrics.reader import get_metrics_snapshot

        from areal_npu.spec.acceptance import SpecCounters

        return SpecCounters.from_vllm_metrics(get_metrics_snapshot(), now=time.time()).to_dict()

    @router.post("/update_weights/begin")
    async def begin(request: Request):
        await _body(request, request_body.NOTHING)
        async with state.lock:
            if state.updating:
                raise HTTPException(status_code=409, detail="a weight update is already in progress")
            await state.engine.pause_generation(mode="keep", clear_cache=False)
            state.updating = True
            state.loaded = {}
            state.update_started = time.perf_counter()
        return {"version": state.version}

    @router.post("/update_weights/bucket")
    async def bucket(request: Request, target: str = "policy"):
        _checked(lambda: request_body.validate({"target": target}, request_body.TARGET))
        payload = await request.body()
        if not payload:
            raise HTTPException(status_code=400, detail="body must hold one bucket of weights; got 0 bytes")
        async with state.lock:
            if not state.updating:
                raise HTTPException(status_code=409, detail="call /areal/update_weights/begin first")
            if target == "draft" and not state.cfg.spec.sync_draft:
                raise HTTPException(status_code=400, detail="spec.sync_draft is false: the drafter is frozen")
            await state.switch_target(target)
            counts = await state.rpc("areal_load_bucket", target, payload)
        return {"loaded": int(counts[0])}

    @router.post("/update_weights/commit")
    async def commit(request: Request):
        body = await _body(request, request_body.COMMIT)
        async with state.lock:
            if not state.updating:
                raise HTTPException(status_code=409, detail="no weight update in progress")
            try:
                await state.switch_target(None)
            except Exception as exc:
                # weights are half-loaded: stay paused; the caller restarts this engine
                state.updating = False
                state.active_target = None
                state.failed_update = f"{type(exc).__name__}: {exc}"
                raise HTTPException(
                    status_code=500, detail=f"weight update failed: {state.failed_update}"
                ) from exc
            state.version = state.version + 1 if body["version"] is None else body["version"]
            state.updating = False
            await state.engine.resume_generation()
            seconds = time.perf_counter() - state.update_started
        return {"version": state.version, "loaded": state.loaded, "seconds": seconds}

    @router.post("/update_weights/collective/init")
    async def collective_init(request: Request):
        body = await _body(request, request_body.COLLECTIVE_INIT)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await state.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=body["init_info"]))
        return {"ok": True}

    @router.post("/update_weights/collective/start")
    async def collective_start(request: Request):
        body = await _body(request, request_body.TARGET)
        if body["target"] == "draft":
            if not vllm_features.has("draft_weight_transfer"):
                raise HTTPException(
                    status_code=400,
                    detail=f"vLLM {vllm_features.installed_version()}'s weight-transfer engines load the "
                    "target model only; send the drafter's mtp.* tensors as rpc buckets "
                    "(/areal/update_weights/bucket?target=draft)",
                )
            await state.engine.start_draft_weight_update()
        else:
            await state.engine.start_weight_update()
        return {"ok": True}

    @router.post("/update_weights/collective/chunk")
    async def collective_chunk(request: Request):
        body = await _body(request, request_body.COLLECTIVE_CHUNK)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await state.engine.update_weights(WeightTransferUpdateRequest(update_info=body["update_info"]))
        return {"ok": True}

    @router.post("/update_weights/collective/finish")
    async def collective_finish(request: Request):
        await _body(request, request_body.NOTHING)
        await state.engine.finish_weight_update()
        return {"ok": True}

    @router.post("/debug/param_sums")
    async def param_sums(target: str = "policy"):
        _checked(lambda: request_body.validate({"target": target}, request_body.TARGET))
        return JSONResponse((await state.rpc("areal_param_sums", target))[0])

    return router


def _vllm_client_errors() -> tuple[type[BaseException], ...]:
    """vLLM's errors for requests it refuses (the caller's fault: 400, so the client does not
    retry them on another engine, nor restart the engine); none where vLLM is absent (the route
    tests). vLLM 0.23's input processor refuses with plain ``ValueError`` (e.g. a prompt longer
    than max_model_len); 0.32 has ``VLLMClientError`` (``vllm_features``)."""
    try:
        import vllm.exceptions
    except ImportError:
        return ()
    if vllm_features.has("client_error_class"):
        return (vllm.exceptions.VLLMClientError,)
    return (ValueError,)


def _refused_by_vllm(exc: BaseException) -> HTTPException:
    field = getattr(exc, "parameter", None) or "request"
    return HTTPException(status_code=400, detail=f"{field} refused by vLLM: {exc}")


def _checked(check):
    """``check()``'s result; a ``BodyError`` it raises answers 400 with the field's sentence."""
    try:
        return check()
    except request_body.BodyError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None


async def _body(request: Request, fields: dict[str, request_body.Field]) -> dict[str, Any]:
    """The request's JSON body checked against ``fields`` (empty means ``{}``), or 400."""
    raw = await request.body()
    return _checked(lambda: request_body.parse(raw, fields))


def _vllm_server_parts():
    """vLLM's OpenAI-server building blocks: 0.32 keeps them in ``vllm.entrypoints.launchers``,
    0.23 in ``vllm.entrypoints.openai.api_server`` (same functions; ``setup_server`` gained
    ``reuse_port``)."""
    from types import SimpleNamespace

    if vllm_features.has("entrypoints_launchers"):
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


async def serve(cfg: RolloutConfig, port: int) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not vllm_features.has("pause_keep"):  # the update routes freeze in-flight requests
        raise RuntimeError(
            f"vLLM {vllm_features.installed_version()} has no pause_generation(mode='keep'); "
            f"needs >= {vllm_features.since_text('pause_keep')}"
        )
    vllm_api = _vllm_server_parts()
    argv = cfg.vllm_cli_args(port)
    if cfg.spec.adaptive:
        # read by the scheduler in vLLM's engine-core process, which inherits this environment
        import tempfile

        control = Path(tempfile.mkdtemp(prefix="areal-spec-k-")) / "k"
        k_driver.write_k(control, cfg.spec.adapt_config().k_init)
        os.environ[k_driver.ENV_FILE] = str(control)
        if not cfg.spec.off_keeps_drafter_kv:
            from areal_npu.compat.vllm import spec_off

            os.environ[spec_off.SKIP_ENV] = "1"  # read in the worker (worker_ext)
    transport = cfg.resolved_transport()
    if transport in TRANSFER_BACKENDS:
        argv += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKENDS[transport]})]
    args = vllm_api.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    vllm_api.validate_parsed_serve_args(args)
    listen_address, sock = vllm_api.setup_server(args)
    async with vllm_api.build_async_engine_client(args) as engine:
        supported = await engine.get_supported_tasks()
        app = vllm_api.build_app(args, supported, engine.model_config)
        await vllm_api.init_app_state(engine, app.state, args, supported)
        app.include_router(make_router(EngineState(engine, cfg)))
        # ours first: vLLM's app has catch-all middleware but no /areal routes
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
        if cfg.spec.adaptive:
            import shutil

            shutil.rmtree(Path(os.environ[k_driver.ENV_FILE]).parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    parser = argparse.ArgumentParser(description="areal-npu rollout engine (vLLM)")
    parser.add_argument("--config", required=True, help="RolloutConfig as a JSON file or JSON string")
    parser.add_argument("--port", type=int, required=True)
    ns = parser.parse_args(argv)
    text = open(ns.config).read() if os.path.isfile(ns.config) else ns.config
    cfg = RolloutConfig.from_dict(json.loads(text))
    for key, value in cfg.engine_env().items():
        os.environ.setdefault(key, value)
    cpus = os.environ.get("AREAL_ENGINE_CPUS")
    if cpus:  # the launcher's core slice (launcher.cpu_binding); vLLM's processes inherit it
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    import uvloop

    uvloop.run(serve(cfg, ns.port))


if __name__ == "__main__":
    main()
