"""The numbers ``areal-npu report`` reads from ``metrics.jsonl`` rows, and how it prints them."""

from __future__ import annotations

import math
import re

from areal_npu import names


def value(v) -> float | None:
    """``v`` as a float when it is a finite number (not a bool), else ``None``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the rows where it is a finite number."""
    pairs = [(r["step"], v) for r in rows if (v := value(r.get(key))) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def indexed_keys(rows: list[dict], pattern: str) -> list[tuple[int, str]]:
    """Keys matching ``pattern`` (one integer group), as (index, key) sorted by index."""
    rx = re.compile(pattern)
    found = {m.group(0): int(m.group(1)) for r in rows for k in r if (m := rx.fullmatch(k))}
    return sorted((i, k) for k, i in found.items())


def backend_keys(rows: list[dict]) -> list[tuple[str, str]]:
    """(backend, key) of every ``env/backend_<backend>`` key in the rows, sorted by backend."""
    rx = re.compile(names.ENV_BACKEND_PATTERN)
    return sorted({(m.group(1), k) for r in rows for k in r if (m := rx.fullmatch(k))})


def start_end(values: list[float]) -> tuple[float, float]:
    """Means of the first and last ``ceil(n / 5)`` values."""
    k = max(1, math.ceil(len(values) / 5))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def human(v) -> str:
    """A number as a person reads it: three significant digits, no exponent from 0.001 up to 1e6."""
    if not isinstance(v, float):
        return str(v)
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    if abs(v) >= 1e6 or abs(v) < 1e-3:
        return f"{v:.2g}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{float(f'{v:.3g}'):g}"


def signed(v: float) -> str:
    """:func:`human` with its sign: ``+0.25``, ``-0.1``, ``+0``."""
    return human(float(v)) if v < 0 else "+" + human(float(v))


def duration(seconds: float) -> str:
    """``83.4 s (0:01:23)``."""
    s = int(round(seconds))
    return f"{seconds:.1f} s ({s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d})"
