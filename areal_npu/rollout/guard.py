"""Who may drive an engine, and how much one request may send: the run's secret and body limits.

The launcher makes one secret per run (:func:`make_secret`) and hands it to each engine process in
its environment (:data:`SECRET_ENV`) -- never on the command line (``/proc/<pid>/cmdline`` is
world-readable), never in the engine's config JSON, a log, the run directory or ``config.yaml``.
The server takes it out of its environment before vLLM starts its own processes, and refuses to
start without one. Every request must carry ``Authorization: Bearer <secret>`` -- what OpenAI
clients send for an API key, so an agent framework reaches vLLM's ``/v1`` routes with
``api_key=<secret>``; without it the answer is 401 before the body is read, and nothing runs.

:class:`EngineGuard` wraps the whole app (vLLM's routes, ours, mounted apps, websockets), so a route
vLLM adds in a later version is covered without being listed. One route stays open: ``GET /health``
(and ``HEAD``). vLLM does not need it open -- nothing of vLLM calls it -- but process supervisors
(the launcher, Kubernetes or Ray probes) ask it without credentials; it answers 200 or 503 and
changes nothing.

Bodies: the weight-bucket route (``/areal/update_weights/bucket``) takes up to the largest bucket
the trainer sends -- ``weight_bucket_bytes``, or the largest single tensor, which travels alone --
plus the safetensors header; every other route a small JSON body sized from ``max_model_len``
(:func:`body_limits`). A larger body is refused with 413: from ``Content-Length`` before reading,
or as soon as a streamed body passes the limit.
"""

from __future__ import annotations

import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_ENV = "AREAL_ENGINE_SECRET"
BUCKET_PATH = "/areal/update_weights/bucket"
OPEN = frozenset({("GET", "/health"), ("HEAD", "/health")})
#: JSON bodies: token ids of a whole context at up to this many bytes each, plus room for the rest
JSON_BYTES_PER_TOKEN = 32
JSON_BASE_BYTES = 256 << 10
#: safetensors header room per tensor (name, dtype, shape, offsets as JSON)
HEADER_BYTES_PER_TENSOR = 512
HEADER_BASE_BYTES = 64 << 10
#: the trainer may export in float32 whatever the checkpoint's dtype
EXPORT_BYTES_PER_ELEMENT = 4


def make_secret() -> str:
    return secrets.token_urlsafe(32)


def auth_headers(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


@dataclass(frozen=True)
class BodyLimits:
    bucket: int  # /areal/update_weights/bucket (raw safetensors)
    other: int  # every other route

    def for_path(self, path: str) -> int:
        return self.bucket if path == BUCKET_PATH else self.other


def checkpoint_tensor_stats(model_dir: str | Path) -> tuple[int, int]:
    """(largest tensor's element count, number of tensors) over ``model_dir``'s safetensors files,
    read from their headers only; (0, 0) when it has none."""
    largest, count = 0, 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError):
            continue
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in entry.get("shape", []):
                numel *= int(d)
            largest, count = max(largest, numel), count + 1
    return largest, count


def body_limits(weight_bucket_bytes: int, max_model_len: int, model_dir: str | Path | None = None) -> BodyLimits:
    """The engine's limits: a bucket route sized from ``weight_bucket_bytes`` and the checkpoint's
    largest tensor (exported in float32 at most), other routes from ``max_model_len``."""
    largest, count = checkpoint_tensor_stats(model_dir) if model_dir else (0, 0)
    payload = max(weight_bucket_bytes, EXPORT_BYTES_PER_ELEMENT * largest)
    header = HEADER_BASE_BYTES + HEADER_BYTES_PER_TENSOR * count
    return BodyLimits(bucket=payload + header, other=JSON_BASE_BYTES + JSON_BYTES_PER_TOKEN * max_model_len)


def install(app, secret: str, limits: BodyLimits) -> None:
    """Put :class:`EngineGuard` outermost on ``app`` (a Starlette / FastAPI app not serving yet).
    vLLM's app setup has already built its middleware stack (``add_middleware`` then refuses), so
    the guard goes first into the middleware list and the stack is built again at the first request."""
    from starlette.middleware import Middleware

    app.user_middleware.insert(0, Middleware(EngineGuard, secret=secret, limits=limits))
    app.middleware_stack = None


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class EngineGuard:
    """ASGI middleware: the run's secret on every route but ``GET /health``, and body limits."""

    def __init__(self, app, secret: str, limits: BodyLimits):
        if not secret:
            raise ValueError("EngineGuard needs the run's secret")
        self.app = app
        self.expected = f"Bearer {secret}".encode()
        self.limits = limits

    def authorized(self, scope) -> bool:
        given = _header(scope, b"authorization")
        return given is not None and hmac.compare_digest(given, self.expected)

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        is_open = kind == "http" and (scope.get("method", "GET"), scope["path"]) in OPEN
        if not is_open and not self.authorized(scope):
            if kind == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _answer(send, 401, "missing or wrong engine secret (Authorization: Bearer <run secret>)",
                                 [(b"www-authenticate", b"Bearer")])  # fmt: skip
        if kind == "websocket":
            return await self.app(scope, receive, send)
        limit = self.limits.for_path(scope["path"])
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _answer(send, 400, "Content-Length is not a number")
            if declared > limit:
                return await _answer(send, 413, _too_large(scope["path"], declared, limit))
        messages, total = [], 0
        while True:  # read the body here, within the limit, then hand it on unchanged
            message = await receive()
            if message["type"] != "http.request":
                messages.append(message)
                break
            total += len(message.get("body", b""))
            if total > limit:
                return await _answer(send, 413, _too_large(scope["path"], total, limit))
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def _too_large(path: str, size: int, limit: int) -> str:
    return f"body of {size} bytes is larger than {path} takes ({limit} bytes)"


async def _answer(send, status: int, detail: str, headers: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *(headers or [])],
        }
    )  # fmt: skip
    await send({"type": "http.response.body", "body": body})
