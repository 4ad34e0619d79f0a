"""``/areal`` routes that generate: ``generate`` (token ids in; per sample the generated ids, the
behaviour log-prob and weight version of every token, the finish reason and the request's
speculative-decoding summary), ``pause`` and ``resume``.

Nothing is generated while the model holds partly loaded weights (503), and ``resume`` does not
end a pause a weight update holds (409): see ``weight_routes.py``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from areal_npu.rollout import raw_sampling, request_body
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.engine_state import EngineState
from areal_npu.rollout.route_errors import checked, read_body, refused_by_vllm, vllm_client_errors


def checked_top_k(body: dict[str, Any], cfg: RolloutConfig) -> int:
    """The request's top-k (0: none), refused together with speculation (a validated ``body``); on
    an engine that returns raw log-probs, any temperature (but greedy 0), top-p or top-k that
    transforms the distribution is refused too (``raw_sampling``)."""
    top_k = cfg.top_k if body["top_k"] is None else body["top_k"]
    if cfg.spec.enabled and top_k > 0:
        raise request_body.BodyError(
            "top_k", f"= {top_k} with speculative decoding ({cfg.spec.method}) crashes vLLM 0.32; use top_p"
        )
    why = raw_sampling.why_raw(cfg)
    if why is not None:
        sampling = {"temperature": body["temperature"], "top_p": body["top_p"], "top_k": max(top_k, 0)}
        raw_sampling.refuse_transformed(sampling, why)
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


def add_routes(router: APIRouter, state: EngineState) -> None:
    @router.post("/generate")
    async def generate(request: Request):
        body = await read_body(request, request_body.GENERATE)
        if state.dirty is not None:  # partly loaded weights: nothing is generated until a whole update
            raise HTTPException(status_code=503, detail=state.not_now())
        refused = vllm_client_errors()
        try:
            params = _sampling_params(body, checked(lambda: checked_top_k(body, state.cfg)))
        except refused as exc:
            raise refused_by_vllm(exc) from None
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
            raise refused_by_vllm(exc) from None
        return {"request_id": request_id, "prompt_len": len(input_ids), "samples": samples}

    @router.post("/pause")
    async def pause(request: Request):
        body = await read_body(request, request_body.PAUSE)
        await state.engine.pause_generation(mode=body["mode"], clear_cache=False)
        return {"paused": True}

    @router.post("/resume")
    async def resume(request: Request):
        await read_body(request, request_body.NOTHING)
        if state.dirty is not None or state.paused_for_update:
            raise HTTPException(status_code=409, detail=state.not_now())
        await state.engine.resume_generation()
        return {"paused": False}
