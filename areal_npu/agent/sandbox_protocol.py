"""Reading what a sandboxed program's child reported, as untrusted input.

The child writes one frame, ``<nonce> <json>\\n``, to a file the parent created. The program ran
in that child, so everything in the frame may be forged or malformed: this module decodes it with
a size cap, a depth cap and an exact schema, and anything else is ``None`` (reason
"protocol_error", reward 0). Nothing here raises on any byte string.

Values are plain JSON (None, bool, int, str, list) plus floats; non-finite floats travel tagged as
``{"float": "nan" | "inf" | "-inf"}`` (the only object allowed inside a value), so the string
``"nan"`` never equals the float nan.
"""

from __future__ import annotations

import json
import math
from typing import Any

ALLOWED_CHILD_REASONS = ("", "syntax_error", "crash", "memory")
MAX_DEPTH = 32  # deeper values than the harness ever sends are forged
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class Malformed(Exception):
    pass


def _reject_constant(name: str) -> None:
    raise Malformed(f"bare {name} in a frame")


def _decode_value(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise Malformed("value nested too deep")
    kind = type(value)
    if value is None or kind in (bool, int, str, float):
        return value
    if kind is list:
        return [_decode_value(v, depth + 1) for v in value]
    if kind is dict and set(value) == {"float"} and value["float"] in _NON_FINITE:
        return _NON_FINITE[value["float"]]
    raise Malformed(f"value of type {kind.__name__}")


def parse_frame(raw: bytes, nonce: str, n_inputs: int) -> dict | None:
    """``{"reason": str, "results": [("ok", value) | ("err", name)], "layers": [str]}`` or ``None``."""
    try:
        prefix = nonce.encode() + b" "
        if not raw.startswith(prefix) or not raw.endswith(b"\n") or raw.count(b"\n") != 1:
            return None
        body = raw[len(prefix) :]
        if body.count(b"[") + body.count(b"{") > 64 * max(1, n_inputs) + 4096:
            return None  # cheap bound on nesting before the recursive parser sees it
        frame = json.loads(body, parse_constant=_reject_constant)
        if not isinstance(frame, dict) or set(frame) - {"results", "reason", "layers"}:
            return None
        reason, results, layers = frame.get("reason", ""), frame.get("results"), frame.get("layers", [])
        if reason not in ALLOWED_CHILD_REASONS or not isinstance(results, list):
            return None
        if not reason and len(results) != n_inputs:
            return None
        if not isinstance(layers, list) or not all(isinstance(x, str) and len(x) < 64 for x in layers):
            return None
        decoded = []
        for entry in results:
            if not isinstance(entry, dict) or len(entry) != 1:
                return None
            ((key, value),) = entry.items()
            if key == "ok":
                decoded.append(("ok", _decode_value(value)))
            elif key == "err" and isinstance(value, str) and len(value) < 128:
                decoded.append(("err", value))
            else:
                return None
        return {"reason": reason, "results": decoded, "layers": layers[:16]}
    except (Malformed, ValueError, TypeError, RecursionError, MemoryError):
        return None


def same_value(got: Any, expected: Any, depth: int = 0) -> bool:
    """Exact structural equality on decoded values: types must match (``True`` != ``1``, ``1.0`` != ``1``),
    and nan equals nan (a correct program reproducing a nan answer passes)."""
    if type(got) is not type(expected) or depth > MAX_DEPTH + 1:
        return False
    if isinstance(expected, list):
        return len(got) == len(expected) and all(same_value(g, e, depth + 1) for g, e in zip(got, expected))
    if isinstance(expected, float) and math.isnan(expected):
        return math.isnan(got)
    return got == expected


def score(frame: dict, tests) -> tuple[int, str]:
    """``(passed, reason)`` of a decoded frame against ``tests`` (``(input, expected)`` pairs)."""
    passed, errors = 0, []
    for (kind, value), (_, expected) in zip(frame["results"], tests):
        if kind == "ok" and same_value(value, expected):
            passed += 1
        elif kind == "err":
            errors.append(value)
    total = len(tests)
    if passed == total:
        return passed, "ok"
    if "MemoryError" in errors:
        return passed, "memory"
    if "OutputTooLong" in errors:
        return passed, "output_limit"
    if errors and not passed and len(errors) == total:
        return passed, "crash"
    return passed, "wrong_answer"
