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
COMMIT = {"version": Field(INT, None, nullable=True, check=at_least(0))}
TARGET = {"target": Field(STR, "policy", check=one_of(*TARGETS))}
COLLECTIVE_INIT = {"init_info": Field(OBJECT)}
COLLECTIVE_CHUNK = {"update_info": Field(OBJECT)}


def spec_k_fields(k_max: int) -> dict[str, Field]:
    return {"k": Field(Kind(f"an integer in [0, {k_max}]", lambda v: _is_int(v) and 0 <= v <= k_max))}
