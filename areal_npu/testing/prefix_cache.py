"""vLLM's prefix-cache counters of a running engine server, for the stale-prefix test and
``scripts/bench_prefix_cache.py``: tokens looked up in the cache (``queries``) and tokens found
(``hits``), cumulative since the engine started, read from its Prometheus ``/metrics``."""

from __future__ import annotations

COUNTERS = {"queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total"}


def parse(text: str) -> dict[str, float]:
    """``{"queries": ..., "hits": ...}`` summed over the samples' labels (one engine core: one sample)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]  # `name{labels} value` or `name value`
        for key, metric in COUNTERS.items():
            if name == metric:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def read(engine, timeout: float = 30.0) -> dict[str, float]:
    """The counters of ``engine`` (an ``EngineProcess``: its URL and the run's secret)."""
    import httpx

    from areal_npu.rollout import guard

    response = httpx.get(engine.url + "/metrics", headers=guard.auth_headers(engine.secret), timeout=timeout)
    response.raise_for_status()
    return parse(response.text)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in COUNTERS}
