"""How an ``/areal`` route refuses a request: a body that fails its route's fields
(``request_body.py``) or a request vLLM refuses answers 400 naming what is wrong, never 500, so the
client neither retries it on another engine nor restarts the engine."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Request

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.rollout import request_body


def checked(check):
    """``check()``'s result; a ``BodyError`` it raises answers 400 with the field's sentence."""
    try:
        return check()
    except request_body.BodyError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from None


async def read_body(request: Request, fields: dict[str, request_body.Field]) -> dict[str, Any]:
    """The request's JSON body checked against ``fields`` (empty means ``{}``), or 400."""
    raw = await request.body()
    return checked(lambda: request_body.parse(raw, fields))


def vllm_client_errors() -> tuple[type[BaseException], ...]:
    """vLLM's errors for requests it refuses (the caller's fault: 400, so the client does not
    retry them on another engine, nor restart the engine); none where vLLM is absent (the route
    tests). vLLM 0.23's input processor refuses with plain ``ValueError`` (e.g. a prompt longer
    than max_model_len); 0.32 has ``VLLMClientError`` (``compat/vllm/features.py``)."""
    try:
        import vllm.exceptions
    except ImportError:
        return ()
    if vllm_version.has("client_error_class"):
        return (vllm.exceptions.VLLMClientError,)
    return (ValueError,)


def refused_by_vllm(exc: BaseException) -> HTTPException:
    field = getattr(exc, "parameter", None) or "request"
    return HTTPException(status_code=400, detail=f"{field} refused by vLLM: {exc}")
