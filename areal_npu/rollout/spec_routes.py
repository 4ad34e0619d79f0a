"""``/areal`` routes of speculative decoding: ``POST /areal/spec_k`` sets the draft length from the
next scheduler step on (engines started with ``spec.adaptive``; 0 = no drafts; ``by_context``: one per
context bucket, each step taking its batch's dominant bucket's), through the control
file of :mod:`areal_npu.speculation.k_driver`; ``GET /areal/metrics`` answers the engine's cumulative
acceptance counters (:class:`areal_npu.speculation.acceptance.SpecCounters`) as JSON, on every vLLM
version (per-request summaries exist only where vLLM has them)."""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException, Request

from areal_npu.rollout import request_body
from areal_npu.rollout.engine_state import EngineState
from areal_npu.rollout.route_errors import read_body
from areal_npu.speculation import k_driver


def add_routes(router: APIRouter, state: EngineState) -> None:
    @router.post("/spec_k")
    async def set_spec_k(request: Request):
        if not state.cfg.spec.adaptive or state.spec_k_file is None:
            raise HTTPException(status_code=400, detail="this engine was not started with spec.adaptive")
        body = await read_body(request, request_body.spec_k_fields(state.cfg.spec.num_speculative_tokens))
        k, by_context = body["k"], body["by_context"]
        k_driver.write_k(state.spec_k_file, k, by_context)
        state.spec_k = k
        return {"k": k} | ({"by_context": by_context} if by_context is not None else {})

    @router.get("/metrics")
    async def metrics():
        from vllm.v1.metrics.reader import get_metrics_snapshot

        from areal_npu.speculation.acceptance import SpecCounters

        return SpecCounters.from_vllm_metrics(get_metrics_snapshot(), now=time.time()).to_dict()
