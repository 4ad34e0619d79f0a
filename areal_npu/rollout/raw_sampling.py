"""Sampling a raw-log-prob engine refuses: π_behave must be the probability of the distribution a
token was sampled from.

An engine in ``raw_logprobs`` mode (``RolloutConfig.logprobs_mode``: speculative decoding on, or a
vLLM whose processed log-probs are not checked) returns ``log_softmax`` of the model's own logits.
Those are the sampled distribution's only when nothing transforms it: temperature 1, no top-p /
top-k / min-p truncation, no penalty or bias. A request asking for anything else would come back with
behaviour log-probs of a distribution it was not sampled from, so it is refused (400 naming the
field): on ``/areal/generate`` (which always returns log-probs), and on vLLM's OpenAI routes when
the request asks for log-probs (:class:`RawSamplingGuard`; a request without them gets what it asked
for). Greedy decoding (temperature 0) is let through: it has no sampling distribution (the engine
returns the model's log-probs in either mode) and no workflow trains on it (``workflow.temperature``
must be > 0). An engine in ``processed_logprobs`` mode returns the transformed distribution's and
refuses none of these here.
"""

from __future__ import annotations

import json
from typing import Any

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.rollout.config import RolloutConfig
from areal_npu.rollout.request_body import BodyError

#: field -> the values that leave the model's distribution as it is (None: vLLM's own default)
NEUTRAL: dict[str, tuple] = {
    "temperature": (None, 1, 0),  # 0: greedy, see the module docstring
    "top_p": (None, 1),
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
}
#: body fields through which an OpenAI-style request asks for log-probs (false / null: it does not; 0
#: asks for the chosen token's own)
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")


def why_raw(cfg: RolloutConfig) -> str | None:
    """Why an engine started from ``cfg`` returns raw log-probs (for the refusal); None when it
    returns processed ones."""
    if cfg.logprobs_mode() != "raw_logprobs":
        return None
    if cfg.spec.enabled:
        return f"speculative decoding ({cfg.spec.method}) is on, where vLLM's processed log-probs are wrong"
    return f"the processed log-probs of vLLM {vllm_version.installed_version() or '(none)'} are not checked"


def transformed(values: dict[str, Any], defaults: dict[str, Any] | None = None) -> tuple[str, Any] | None:
    """The first sampling field of ``values`` (missing ones: ``defaults``, the engine's own, e.g. a
    model's generation config) that transforms the model's distribution, with its value; else None."""
    for name, neutral in NEUTRAL.items():
        value = values.get(name)
        value = (defaults or {}).get(name) if value is None else value  # null: vLLM's default applies
        if isinstance(value, bool) or not any(value == n for n in neutral):  # JSON true is not 1
            return name, value
    return None


def refuse_transformed(values: dict[str, Any], why: str, defaults: dict[str, Any] | None = None) -> None:
    """A ``BodyError`` naming the field when ``values`` transform the distribution on a raw engine."""
    found = transformed(values, defaults)
    if found is None:
        return
    name, value = found
    neutral = NEUTRAL[name][1] if len(NEUTRAL[name]) > 1 else None
    raise BodyError(
        name,
        f"= {json.dumps(value)[:60]} is refused by this engine: it returns raw log-probs ({why}), "
        f"the model's own distribution, not the one this {name} samples from, so the behaviour log-probs "
        f"would be wrong; use {json.dumps(neutral)} (or an engine without speculation on vLLM >= 0.32)",
    )


def asks_for_logprobs(body: dict[str, Any]) -> bool:
    return any(body.get(name) is not None and body.get(name) is not False for name in LOGPROB_FIELDS)


class RawSamplingGuard:
    """ASGI middleware for vLLM's own routes on a raw-log-prob engine: a JSON ``POST`` that asks for
    log-probs with a transformed distribution answers 400 in OpenAI's error shape. ``/areal`` routes
    check their own bodies; every other path is covered without being listed (routes vLLM adds later
    too). ``defaults``: the sampling fields vLLM fills in when a request omits them (the model's
    generation config, ``ModelConfig.get_diff_sampling_param``)."""

    def __init__(self, app, why: str, defaults: dict[str, Any] | None = None):
        self.app = app
        self.why = why
        self.defaults = dict(defaults or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"].startswith("/areal/"):
            return await self.app(scope, receive, send)
        messages = []
        while True:  # the guard outside this one has bounded the body already
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        raw = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        try:
            body = json.loads(raw) if raw.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            body = None  # not ours to judge: vLLM answers it
        if isinstance(body, dict) and asks_for_logprobs(body):
            try:
                refuse_transformed(body, self.why, self.defaults)
            except BodyError as exc:
                return await _openai_error(send, exc)

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def install(app, why: str, defaults: dict[str, Any] | None = None) -> None:
    """Put :class:`RawSamplingGuard` first into ``app``'s middleware list (call before
    ``guard.install``, which goes outside it: a request without the secret never reaches it)."""
    from starlette.middleware import Middleware

    app.user_middleware.insert(0, Middleware(RawSamplingGuard, why=why, defaults=defaults))
    app.middleware_stack = None


async def _openai_error(send, exc: BodyError) -> None:
    error = {"message": str(exc), "type": "BadRequestError", "param": exc.field, "code": 400}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
