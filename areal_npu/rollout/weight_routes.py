"""``/areal/update_weights/*``: one versioned update of the policy and the MTP drafter, whole or not
at all.

* RPC buckets (``bucket``: safetensors bodies) are *staged* in the engine process while it keeps
  generating with the weights it has; ``commit`` (with the tensor counts the trainer sent) checks
  that every bucket arrived, then pauses, loads them all through ``collective_rpc``
  (``worker_ext.py``), resets the prefix cache, sets the new version and resumes. A session that is
  abandoned (``abort``, a new ``begin``, a missing bucket) leaves the engine exactly as it was.
* The broadcast (``collective/init``, ``collective/bucket``; ``collective.py``: hccl / nccl / gloo)
  loads each bucket straight into the model, so generation is paused from the first such bucket to
  the commit. If such a session fails the engine holds partly loaded weights (``EngineState.dirty``):
  it stays paused, refuses ``resume`` and new generations, until a complete update commits or it
  is restarted -- never serving a version it got part of.

Both paths end in the same ``commit``: with ``rollout.enable_prefix_caching`` it resets vLLM's prefix
cache after the last tensor (policy and drafter) is loaded and before generation resumes
(``EngineState.drop_stale_kv``), so no prefix cached under version v is served at v+1. A reset vLLM
does not confirm fails the commit like a failed load: the engine stays paused until a whole update.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from areal_npu.rollout import request_body
from areal_npu.rollout.engine_state import EngineState, UpdateSession
from areal_npu.rollout.route_errors import checked, read_body


def _open_session(state: EngineState) -> UpdateSession:
    if state.session is None:
        raise HTTPException(status_code=409, detail="no weight update in progress: call /areal/update_weights/begin")
    return state.session


def _check_target(state: EngineState, target: str) -> None:
    if target == "draft" and not state.cfg.spec.sync_draft:
        raise HTTPException(status_code=400, detail="spec.sync_draft is false: the drafter is frozen")


def add_routes(router: APIRouter, state: EngineState) -> None:
    @router.post("/update_weights/begin")
    async def begin(request: Request):
        await read_body(request, request_body.NOTHING)
        async with state.lock:
            await state.abandon("a new update began before the previous one committed")
            state.session = UpdateSession()
            state.loaded = {}
        return {"version": state.version, "dirty": state.dirty}

    @router.post("/update_weights/bucket")
    async def bucket(request: Request, target: str = "policy"):
        checked(lambda: request_body.validate({"target": target}, request_body.TARGET))
        payload = await request.body()
        tensors = checked(lambda: request_body.safetensors_count(payload))
        async with state.lock:
            session = _open_session(state)
            _check_target(state, target)
            session.staged.append((target, payload))
            session.add(target, tensors)
        return {"staged": tensors}

    @router.post("/update_weights/commit")
    async def commit(request: Request):
        body = await read_body(request, request_body.COMMIT)
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
                await state.drop_stale_kv()  # loaded and still paused: no KV of the old weights survives
            except Exception as exc:
                # weights half-loaded, or loaded over a stale cache: stay paused; the caller re-sends
                # everything (whose commit resets again) or restarts us
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
        await read_body(request, request_body.NOTHING)
        async with state.lock:
            await state.abandon("the trainer abandoned the update")
        return {"version": state.version, "dirty": state.dirty}

    @router.post("/update_weights/collective/init")
    async def collective_init(request: Request):
        body = await read_body(request, request_body.COLLECTIVE_INIT)
        async with state.lock:
            if state.session is not None and state.session.touched:
                raise HTTPException(status_code=409, detail="a broadcast update is in progress")
            ranks = await state.rpc("areal_collective_init", body["group"], state.cfg.host)
        return {"ranks": [int(r) for r in ranks]}

    @router.post("/update_weights/collective/bucket")
    async def collective_bucket(request: Request):
        body = await read_body(request, request_body.COLLECTIVE_BUCKET)
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
        checked(lambda: request_body.validate({"target": target}, request_body.TARGET))
        return JSONResponse((await state.rpc("areal_param_sums", target))[0])
