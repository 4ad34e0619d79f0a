#!/usr/bin/env python
"""Rollout benchmark: MTP speculative vs autoregressive decoding through the rollout engine.

Same model, same prompts, same engine code path as RL rollouts (``areal_npu.rollout``: server
process, async client, ``raw_logprobs``): one engine per k (k = 0 is autoregressive), one at a
time, batch sizes 1, 8 and 64 concurrent requests, every request generating ``--max-tokens`` tokens
(``ignore_eos``). Per cell: generated tokens / s (best of ``--repeats`` runs, wall clock of the
whole batch), the acceptance rate and mean accepted length (deltas of the engine's counters), the
measured speed-up over k = 0 at the same batch size, and two predictions from acceptance:

* ``ideal``     = mean accepted length tau (tokens per verify step; drafting free, verify = one step);
* ``predicted`` = tau / (1 + k * c), c = cost of one draft step relative to one target step,
  estimated as MTP layers / decoder layers (drafter layers over the target's, lm_head ignored).

Heads (``--head``):

* ``trained`` (default): the tiny Qwen3.5 and its MTP head trained jointly with the project's SFT
  warm start (``areal_npu.model.warmstart``, pattern corpus, ``--train-steps``), prompts from the
  same corpus -- a head trained like the real one, on text it has learned;
* ``oracle``: ``areal_npu.rollout.synthetic``, the near-oracle head (upper bound of acceptance);
* ``random``: the untrained head (acceptance ~0: the cost of speculation that does not pay).

If the trained head cannot be built (warm start unavailable), the bench says so and uses ``oracle``.

    .venv/bin/python scripts/bench_rollout.py [--quick] [--head trained|oracle|random] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from areal_npu.rollout.client import RolloutClient
from areal_npu.rollout.config import RolloutConfig, SpecConfig
from areal_npu.rollout.launcher import EngineProcess
from areal_npu.rollout.metrics import counter_delta, spec_stats


def build_trained(out: Path, steps: int, depths: int) -> tuple[Path, list[list[int]], dict]:
    import torch

    from areal_npu.model.mtp import MTPConfig
    from areal_npu.model.mtp_checkpoint import save_model_with_mtp
    from areal_npu.model.tiny import TinyModelConfig, build_tiny_model
    from areal_npu.model.warmstart import evaluate_mtp, pattern_corpus, sft_warm_start

    torch.manual_seed(0)
    model, mtp, tokenizer = build_tiny_model(TinyModelConfig())
    corpus = pattern_corpus(64, length=64, seed=0)
    batches = [corpus[i : i + 8] for i in range(0, len(corpus), 8)]
    cfg = MTPConfig(enabled=True, num_depths=depths)
    start = time.perf_counter()
    history = sft_warm_start(model, mtp, batches, steps, cfg, log_every=max(steps, 1))
    evaluation = evaluate_mtp(model, mtp, batches[:2], num_depths=depths)
    path = save_model_with_mtp(model, mtp, out, tokenizer)
    prompts = [c[:16].tolist() for c in pattern_corpus(64, length=16, seed=1)]
    info = {
        "train_steps": steps,
        "train_seconds": round(time.perf_counter() - start, 1),
        "final": {k: round(v, 4) for k, v in history[-1].items() if isinstance(v, float)},
        "eval": {k: round(v, 4) for k, v in evaluation.items() if "acc" in k},
    }
    return path, prompts, info


def build_model(head: str, out: Path, steps: int, depths: int) -> tuple[str, Path, list[list[int]], dict]:
    rng = random.Random(0)
    byte_prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(64)]
    if head == "trained":
        cached = out / f"trained-{steps}-{depths}.json"
        if cached.is_file():
            info = json.loads(cached.read_text())
            return "trained", Path(info.pop("path")), info.pop("prompts"), info
        try:
            path, prompts, info = build_trained(out / f"trained-{steps}-{depths}", steps, depths)
            cached.write_text(json.dumps({**info, "path": str(path), "prompts": prompts}))
            return "trained", path, prompts, info
        except Exception as exc:  # noqa: BLE001 - fall back, and say so
            print(f"[bench] trained head unavailable ({type(exc).__name__}: {exc}); using the oracle head")
            head = "oracle"
    if head == "oracle":
        from areal_npu.rollout.synthetic import save_aligned_model

        return "oracle", save_aligned_model(out / "oracle"), byte_prompts, {}
    from areal_npu.model.tiny import save_tiny_model

    return "random", save_tiny_model(out / "random"), byte_prompts, {}


async def _run_batch(client, prompts, batch, max_tokens, temperature) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.generate(
                prompts[i % len(prompts)], max_tokens=max_tokens, temperature=temperature, ignore_eos=True
            )
            for i in range(batch)
        )
    )
    seconds = time.perf_counter() - start
    failed = [r.error for r in results if r.failed]
    if failed:
        raise RuntimeError(failed[0])
    return sum(len(r.samples[0].output_ids) for r in results) / seconds


async def measure(
    engine: EngineProcess, prompts, batch: int, max_tokens: int, temperature: float, repeats: int
) -> dict:
    """Best of ``repeats`` runs: the machine is shared, the best run is the least disturbed one.
    Acceptance pooled over all runs."""
    async with RolloutClient([engine], max_retries=0) as client:
        # warm-up: first requests allocate
        await asyncio.gather(
            *(client.generate(p, max_tokens=8, temperature=temperature) for p in prompts[:batch])
        )
        before = await client.counters()
        runs = [await _run_batch(client, prompts, batch, max_tokens, temperature) for _ in range(repeats)]
        after = await client.counters()
    stats = spec_stats(counter_delta(before, after), prefix="")
    return {
        "tokens_per_s": max(runs),
        "tokens_per_s_runs": [round(x, 1) for x in runs],
        "accept_rate": stats["spec_accept_rate"],
        "mean_accepted_len": stats["spec_mean_accepted_len"],
        "accept_rate_per_pos": [
            round(stats[k], 4) for k in sorted(stats) if k.startswith("spec_accept_rate_pos")
        ],
    }


def start_engine(model_dir: Path, k: int, work: Path, max_seqs: int) -> EngineProcess:
    spec = SpecConfig(method="mtp", num_speculative_tokens=k) if k else SpecConfig()
    cfg = RolloutConfig(model=str(model_dir), max_model_len=1024, spec=spec, log_dir=str(work / "logs"),
                        startup_timeout_s=900, extra_engine_args={"max_num_seqs": max_seqs})  # fmt: skip
    cfg.validate()
    engine = EngineProcess(cfg, index=k)
    t0 = time.perf_counter()
    engine.start()
    print(f"[bench] k={k}: engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    return engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer tokens and training steps (a few minutes)"
    )
    parser.add_argument("--head", choices=("trained", "oracle", "random"), default="trained")
    parser.add_argument("--ks", default="0,1,2,3,4", help="draft lengths; 0 = autoregressive baseline")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=0, help="default 256 (64 with --quick)")
    parser.add_argument("--temperature", type=float, default=1.0, help="1.0 = RL rollouts; 0 = greedy")
    parser.add_argument("--train-steps", type=int, default=0, help="default 120 (40 with --quick)")
    parser.add_argument("--workdir", default="", help="models and logs; a trained model found here is reused")
    parser.add_argument(
        "--repeats", type=int, default=0, help="runs per cell, best kept (default 3; 2 with --quick)"
    )
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    steps = args.train_steps or (40 if args.quick else 120)
    repeats = args.repeats or (2 if args.quick else 3)
    if 0 not in ks:
        ks = [0, *ks]

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-rollout-"))
    head, model_dir, prompts, head_info = build_model(args.head, work, steps, depths=max(ks))
    print(f"[bench] head={head} model={model_dir} {json.dumps(head_info)}", flush=True)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    draft_cost = getattr(hf, "mtp_num_hidden_layers", 1) / hf.num_hidden_layers

    rows = []
    # One engine at a time: vLLM's CPU backend pins every engine's compute to the same core, so a
    # second live engine (even idle) would distort the one measured.
    for k in ks:
        engine = start_engine(model_dir, k, work, max(batches))
        try:
            for batch in batches:
                row = {"k": k, "batch": batch}
                row.update(
                    asyncio.run(measure(engine, prompts, batch, max_tokens, args.temperature, repeats))
                )
                rows.append(row)
                keys = ("k", "batch", "tokens_per_s", "mean_accepted_len")
                print(f"[bench] {json.dumps({key: row[key] for key in keys})}", flush=True)
        finally:
            engine.stop()
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["batch"]]
        r["ideal_speedup"] = r["mean_accepted_len"] if r["k"] else 1.0
        r["predicted_speedup"] = r["mean_accepted_len"] / (1 + r["k"] * draft_cost) if r["k"] else 1.0
    print_table(rows, head, max_tokens, args.temperature, draft_cost)
    if args.json:
        payload = {
            "head": head,
            "head_info": head_info,
            "model": {"hidden": hf.hidden_size, "layers": hf.num_hidden_layers, "vocab": hf.vocab_size},
            "max_tokens": max_tokens,
            "temperature": args.temperature,
            "draft_cost": draft_cost,
            "quick": args.quick,
            "repeats": repeats,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def print_table(rows, head, max_tokens, temperature, draft_cost) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rollout: MTP speculative vs autoregressive (head={head}, {max_tokens} tokens, T={temperature}, c={draft_cost:.2f})"
    )
    for col in ("k", "batch", "tok/s", "accept", "mean acc. len", "speedup", "ideal", "predicted"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["k"]),
            str(r["batch"]),
            f"{r['tokens_per_s']:.0f}",
            f"{r['accept_rate']:.2f}" if r["k"] else "-",
            f"{r['mean_accepted_len']:.2f}" if r["k"] else "-",
            f"{r['speedup']:.2f}x",
            f"{r['ideal_speedup']:.2f}x",
            f"{r['predicted_speedup']:.2f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
