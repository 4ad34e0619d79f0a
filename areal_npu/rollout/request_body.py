"""What the engine's ``/areal`` routes accept in their JSON bodies, checked before any engine work.

A missing or wrong-typed field answers 400 naming the field (a ``KeyError`` deep inside a route
would answer 500 and tell the caller nothing); unknown fields are refused as well, so nothing is
accepted and ignored. Pure Python, so the rules are tested without vLLM or FastAPI.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REQUIRED = object()
TARGETS = ("policy", "draft")


class BodyError(ValueError):
    """A request body the route refuses; ``field`` names the offending entry (``body`` for all of it)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field} {message}")


@dataclass(frozen=True)
class Kind:
    """A JSON value type: ``name`` for the error message, ``accepts`` the test."""

    name: str
    accepts: Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not the integer 1


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


INT = Kind("an integer", _is_int)
NUMBER = Kind("a finite number", _is_number)
BOOL = Kind("a boolean", lambda v: isinstance(v, bool))
STR = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("a JSON object", lambda v: isinstance(v, dict))
TOKEN_IDS = Kind(
    "a list of non-negative integer token ids",
    lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
)


@dataclass(frozen=True)
class Field:
    """One body entry: its kind, its default (``REQUIRED`` when it has none), whether JSON null is
    allowed, and an extra check returning a problem sentence or None."""

    kind: Kind
    default: Any = REQUIRED
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None


def at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low}; got {v!r}"


def between(low: float, high: float, low_open: bool = False) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = (low < v if low_open else low <= v) and v <= high
        return None if ok else f"must be in {'(' if low_open else '['}{low}, {high}]; got {v!r}"

    return check


def one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}; got {v!r}"


def non_empty(v: Any) -> str | None:
    return None if len(v) else "must not be empty"


def validate(body: Any, fields: dict[str, Field]) -> dict[str, Any]:
    """``body`` checked against ``fields``: every field present (defaults filled in) or a ``BodyError``."""
    if not isinstance(body, dict):
        raise BodyError("body", f"must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BodyError(unknown[0], f"is not a field of this route (accepted: {', '.join(fields) or 'none'})")
    values = {}
    for name, field in fields.items():
        if name not in body:
            if field.default is REQUIRED:
                raise BodyError(name, f"is required ({field.kind.name})")
            values[name] = field.default
            continue
        value = body[name]
        if value is None and field.nullable:
            values[name] = None
            continue
        if not field.kind.accepts(value):
            raise BodyError(name, f"must be {field.kind.name}; got {json.dumps(value)[:80]}")
        problem = field.check(value) if field.check is not None else None
        if problem:
            raise BodyError(name, problem)
        values[name] = value
    return values


def parse(raw: bytes, fields: dict[str, Field]) -> dict[str, Any]:
    """Raw request bytes (empty means ``{}``) checked against ``fields``."""
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BodyError("body", f"is not valid JSON ({exc})") from None
    return validate(body, fields)


# The sampling defaults match the client's (``RolloutClient.generate``); top_k None means the
# engine's configured ``rollout.top_k``.
GENERATE = {
    "input_ids": Field(TOKEN_IDS, check=non_empty),
    "request_id": Field(STR, None, nullable=True),
    "n": Field(INT, 1, check=at_least(1)),
    "temperature": Field(NUMBER, 1.0, check=at_least(0)),
    "top_p": Field(NUMBER, 1.0, check=between(0, 1, low_open=True)),
    "top_k": Field(INT, None, nullable=True, check=at_least(-1)),
    "max_tokens": Field(INT, 256, check=at_least(1)),
    "stop_token_ids": Field(TOKEN_IDS, None, nullable=True),
    "ignore_eos": Field(BOOL, False),
    "seed": Field(INT, None, nullable=True),
}
PAUSE = {"mode": Field(STR, "keep", check=one_of("keep", "abort", "wait"))}
NOTHING: dict[str, Field] = {}  # routes without parameters still refuse stray fields
TARGET = {"target": Field(STR, "policy", check=one_of(*TARGETS))}


def _tensor_counts(v: Any) -> str | None:
    """``expect``: target -> number of tensors the trainer sent."""
    for key, n in v.items():
        if key not in TARGETS:
            return f"keys must be among {', '.join(TARGETS)}; got {key!r}"
        if not _is_int(n) or n < 0:
            return f"[{key!r}] must be a non-negative integer; got {json.dumps(n)[:40]}"
    return None


#: ``collective.GroupInfo``'s fields and their kinds
GROUP_FIELDS = {
    "backend": Field(STR, check=one_of("hccl", "nccl", "gloo")),
    "host": Field(STR, check=non_empty),
    "port": Field(INT, check=between(1, 65535)),
    "prefix": Field(STR, check=non_empty),
    "world_size": Field(INT, check=at_least(2)),
    "rank_offset": Field(INT, check=at_least(1)),
    "timeout_s": Field(NUMBER, check=between(0, 86400, low_open=True)),
}


def _group(v: Any) -> str | None:
    try:
        validate(v, GROUP_FIELDS)
    except BodyError as exc:
        return f"field {exc}"
    return None


def _layout(v: Any) -> str | None:
    """A bucket's layout (``collective.bucket_layout``): ``nbytes`` and ``[name, dtype, shape, offset]``
    entries that fit in it."""
    if set(v) != {"nbytes", "tensors"}:
        return "must have exactly the keys nbytes and tensors"
    nbytes, tensors = v["nbytes"], v["tensors"]
    if not _is_int(nbytes) or nbytes <= 0:
        return "nbytes must be a positive integer"
    if not isinstance(tensors, list) or not tensors:
        return "tensors must be a non-empty list"
    for entry in tensors:
        ok = (
            isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) and isinstance(entry[1], str)
            and isinstance(entry[2], list) and all(_is_int(d) and d >= 0 for d in entry[2])
            and _is_int(entry[3]) and 0 <= entry[3] <= nbytes
        )  # fmt: skip
        if not ok:
            return f"tensors entries must be [name, dtype, shape, offset] within nbytes; got {json.dumps(entry)[:80]}"
    return None


COMMIT = {
    "version": Field(INT, None, nullable=True, check=at_least(0)),
    "expect": Field(OBJECT, None, nullable=True, check=_tensor_counts),
}
COLLECTIVE_INIT = {"group": Field(OBJECT, check=_group)}
COLLECTIVE_BUCKET = {"target": Field(STR, "policy", check=one_of(*TARGETS)), "layout": Field(OBJECT, check=_layout)}


def safetensors_count(payload: bytes) -> int:
    """Number of tensors in a safetensors ``payload`` (its header only), or a ``BodyError``: a
    bucket is checked when it arrives, not when the staged update is applied."""
    if not payload:
        raise BodyError("body", "must hold one bucket of weights; got 0 bytes")
    size = int.from_bytes(payload[:8], "little") if len(payload) >= 8 else -1
    if size <= 0 or 8 + size > len(payload):
        raise BodyError("body", "is not a safetensors bucket (bad header length)")
    try:
        header = json.loads(payload[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BodyError("body", "is not a safetensors bucket (header is not JSON)") from None
    if not isinstance(header, dict):
        raise BodyError("body", "is not a safetensors bucket (header is not an object)")
    count = sum(1 for name in header if name != "__metadata__")
    if count == 0:
        raise BodyError("body", "holds no tensors")
    return count


def spec_k_fields(k_max: int) -> dict[str, Field]:
    """``k``; ``by_context`` (null: one k for every batch): one k per context bucket
    (``speculation/context.py``), the engine applying the running batch's dominant bucket's."""
    in_range = lambda v: _is_int(v) and 0 <= v <= k_max  # noqa: E731
    table = Kind(
        f"a list of integers in [0, {k_max}]", lambda v: isinstance(v, list) and all(map(in_range, v))
    )
    return {
        "k": Field(Kind(f"an integer in [0, {k_max}]", in_range)),
        "by_context": Field(table, default=None, nullable=True, check=lambda v: non_empty(v)),
    }
