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
* ``POST /areal/update_weights/{begin,bucket,commit,abort}`` -- one versioned update of the policy
  and the MTP drafter. RPC buckets (safetensors bodies) are *staged* in this process while the engine
  keeps generating with the weights it has; ``commit`` (with the tensor counts the trainer sent)
  checks that every bucket arrived, then pauses, loads them all through ``collective_rpc`` (see
  ``worker_ext.py``), sets the new version and resumes. A session that is abandoned (``abort``, a
  new ``begin``, a missing bucket) leaves the engine exactly as it was.
* ``POST /areal/update_weights/collective/{init,bucket}`` -- the broadcast transport
  (``collective.py``: hccl / nccl / gloo): ``init`` joins the trainer's group, each ``bucket`` names a
  bucket's layout and receives it from the trainer's broadcast straight into the model, so
  generation is paused from the first such bucket to the commit. If such a session fails, the
  engine holds partly loaded weights: it stays paused, refuses ``resume`` and new generations (503),
  until a complete update commits or it is restarted -- never serving a version it got part of.
* ``POST /areal/spec_k`` -- ``{"k": K}``: draft length from the next scheduler step on (engines
  started with ``spec.adaptive``; 0 = no drafts; see :mod:`areal_npu.spec.k_driver`).
* ``GET /areal/metrics`` (cumulative acceptance counters as JSON), ``GET /areal/version`` (weight
  version, and the vLLM version and feature map: ``vllm_features.py``).

Every route but ``GET /health`` needs the run's secret (``guard.py``: 401 without it, before the
body is read) and takes a bounded body (413 past it). Every body is checked against its route's
fields (``request_body.py``) before the engine is touched: a missing, wrong-typed or unknown field
answers 400 naming the field.
"""

import argparse
import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from areal_npu.rollout import guard, request_body, vllm_features
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.parent_watch import die_with_parent
from areal_npu.spec import k_driver


class UpdateSession:
    """One weight update between ``begin`` and ``commit``: staged RPC buckets (bytes, per target)
    and the tensors a broadcast already loaded into the model."""

    def __init__(self):
        self.staged: list[tuple[str, bytes]] = []
        self.counts: dict[str, int] = {}  # target -> tensors received (staged or direct)
        self.touched = False  # the model got some of it already (a broadcast, or the apply began)
        self.broadcast = False  # some of it came by the collective broadcast
        self.started = time.perf_counter()

    def add(self, target: str, tensors: int) -> None:
        self.counts[target] = self.counts.get(target, 0) + tensors


class EngineState:
    """Weight version and update session shared by the routes of one engine."""

    def __init__(self, engine, cfg: RolloutConfig):
        self.engine = engine
        self.cfg = cfg
        self.version = 0
        self.session: UpdateSession | None = None
        # why the model holds partly loaded weights (None: it does not); paused while set
        self.dirty: str | None = None
        self.dirty_targets: set[str] = set()  # what a commit must carry to make the engine whole again
        self.paused_for_update = False
        self.active_target: str | None = None
        self.loaded: dict[str, int] = {}
        self.committed = {"rpc": 0, "broadcast": 0}  # updates committed, by how they came
        self.lock = asyncio.Lock()
        self.started = time.time()
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

    async def pause_for_update(self) -> None:
        if not self.paused_for_update:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            self.paused_for_update = True

    async def abandon(self, reason: str) -> None:
        """Drop the open session. Staged buckets never touched the model: the engine goes on as it
        was. Weights already loaded into the model (a broadcast, a failed apply) cannot be taken
        back: the workers' reload is closed, and the engine stays paused and dirty."""
        session, self.session = self.session, None
        if session is None:
            return
        if session.touched or self.active_target is not None:
            self.dirty = reason
            self.dirty_targets |= set(session.counts) | ({self.active_target} - {None})
            with contextlib.suppress(Exception):  # close the workers' reload; the weights stay dirty
                await self.switch_target(None)
            self.active_target = None
        elif self.paused_for_update and self.dirty is None:
            await self.engine.resume_generation()
            self.paused_for_update = False


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
        if state.dirty is not None:  # partly loaded weights: nothing is generated until a whole update
            raise HTTPException(status_code=503, detail=_not_now(state))
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
        if state.dirty is not None or state.paused_for_update:
            raise HTTPException(status_code=409, detail=_not_now(state))
        await state.engine.resume_generation()
        return {"paused": False}

    @router.get("/version")
    async def version():
        return {
            "version": state.version,
            "updating": state.session is not None,
            "dirty": state.dirty,
            "committed": state.committed,
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
            await state.abandon("a new update began before the previous one committed")
            state.session = UpdateSession()
            state.loaded = {}
        return {"version": state.version, "dirty": state.dirty}

    @router.post("/update_weights/bucket")
    async def bucket(request: Request, target: str = "policy"):
        _checked(lambda: request_body.validate({"target": target}, request_body.TARGET))
        payload = await request.body()
        tensors = _checked(lambda: request_body.safetensors_count(payload))
        async with state.lock:
            session = _open_session(state)
            _check_target(state, target)
            session.staged.append((target, payload))
            session.add(target, tensors)
        return {"staged": tensors}

    @router.post("/update_weights/commit")
    async def commit(request: Request):
        body = await _body(request, request_body.COMMIT)
        async with state.lock:
            session = _open_session(state)
            expect = body["expect"]
            if expect is not None and session.counts != {t: n for t, n in expect.items() if n}:
                got = session.counts
                await state.abandon(f"incomplete update: got tensors {got}, the trainer sent {expect}")
                raise HTTPException(
                    status_code=409, detail=f"incomplete update: tensors received {got}, sent {expect}; nothing applied"
                    + ("" if state.dirty is None else " (a broadcast had loaded some: the engine stays paused)"),
                )
            missing = state.dirty_targets - set(session.counts)
            if missing:
                raise HTTPException(
                    status_code=409,
                    detail=f"the engine's {', '.join(sorted(missing))} weights are partly loaded ({state.dirty}); "
                    "a commit must carry them whole",
                )
            session.touched = True
            try:
                await state.pause_for_update()
                for target, payload in session.staged:
                    await state.switch_target(target)
                    await state.rpc("areal_load_bucket", target, payload)
                await state.switch_target(None)
            except Exception as exc:
                # weights are half-loaded: stay paused; the caller re-sends everything or restarts us
                await state.abandon(f"applying the update failed: {type(exc).__name__}: {exc}")
                raise HTTPException(status_code=500, detail=f"weight update failed: {state.dirty}") from exc
            state.session = None
            state.committed["broadcast" if session.broadcast else "rpc"] += 1
            state.dirty, state.dirty_targets = None, set()
            state.version = state.version + 1 if body["version"] is None else body["version"]
            await state.engine.resume_generation()
            state.paused_for_update = False
            seconds = time.perf_counter() - session.started
        return {"version": state.version, "loaded": state.loaded, "seconds": seconds}

    @router.post("/update_weights/abort")
    async def abort(request: Request):
        await _body(request, request_body.NOTHING)
        async with state.lock:
            await state.abandon("the trainer abandoned the update")
        return {"version": state.version, "dirty": state.dirty}

    @router.post("/update_weights/collective/init")
    async def collective_init(request: Request):
        body = await _body(request, request_body.COLLECTIVE_INIT)
        async with state.lock:
            if state.session is not None and state.session.touched:
                raise HTTPException(status_code=409, detail="a broadcast update is in progress")
            ranks = await state.rpc("areal_collective_init", body["group"], state.cfg.host)
        return {"ranks": [int(r) for r in ranks]}

    @router.post("/update_weights/collective/bucket")
    async def collective_bucket(request: Request):
        body = await _body(request, request_body.COLLECTIVE_BUCKET)
        target, layout = body["target"], body["layout"]
        async with state.lock:
            session = _open_session(state)
            _check_target(state, target)
            session.touched = session.broadcast = True
            try:
                await state.pause_for_update()
                await state.switch_target(target)
                counts = await state.rpc("areal_receive_bucket", target, layout)
            except Exception as exc:
                await state.abandon(f"a broadcast failed mid-update: {type(exc).__name__}: {exc}")
                raise HTTPException(status_code=500, detail=f"broadcast failed: {state.dirty}") from exc
            session.add(target, int(counts[0]))
        return {"loaded": int(counts[0])}

    @router.post("/debug/param_sums")
    async def param_sums(target: str = "policy"):
        _checked(lambda: request_body.validate({"target": target}, request_body.TARGET))
        return JSONResponse((await state.rpc("areal_param_sums", target))[0])

    return router


def _open_session(state: EngineState) -> UpdateSession:
    if state.session is None:
        raise HTTPException(status_code=409, detail="no weight update in progress: call /areal/update_weights/begin")
    return state.session


def _check_target(state: EngineState, target: str) -> None:
    if target == "draft" and not state.cfg.spec.sync_draft:
        raise HTTPException(status_code=400, detail="spec.sync_draft is false: the drafter is frozen")


def _not_now(state: EngineState) -> str:
    if state.dirty is not None:
        return f"the engine holds partly loaded weights ({state.dirty}); waiting for a complete update or a restart"
    return "a weight update is loading into the model; generation resumes at its commit"


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


async def serve(cfg: RolloutConfig, port: int, secret: str) -> None:
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
    args = vllm_api.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    vllm_api.validate_parsed_serve_args(args)
    listen_address, sock = vllm_api.setup_server(args)
    async with vllm_api.build_async_engine_client(args) as engine:
        supported = await engine.get_supported_tasks()
        app = vllm_api.build_app(args, supported, engine.model_config)
        await vllm_api.init_app_state(engine, app.state, args, supported)
        app.include_router(make_router(EngineState(engine, cfg)))
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
        if cfg.spec.adaptive:
            import shutil

            shutil.rmtree(Path(os.environ[k_driver.ENV_FILE]).parent, ignore_errors=True)


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
    for key, value in cfg.engine_env().items():
        os.environ.setdefault(key, value)
    cpus = os.environ.get("AREAL_ENGINE_CPUS")
    if cpus:  # the launcher's core slice (launcher.cpu_binding); vLLM's processes inherit it
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    import uvloop

    uvloop.run(serve(cfg, ns.port, secret))


if __name__ == "__main__":
    main()
