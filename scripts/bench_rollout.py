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
  warm start (``areal_npu.testing.sft``, pattern corpus, ``--train-steps``), prompts from the
  same corpus -- a head trained like the real one, on text it has learned;
* ``oracle``: ``areal_npu.testing.synthetic``, the near-oracle head (upper bound of acceptance);
* ``random``: the untrained head (acceptance ~0: the cost of speculation that does not pay).

If the trained head cannot be built (warm start unavailable), the bench says so and uses ``oracle``.

``--adaptive`` runs the adaptive-speculation comparison instead, for a good drafter (the oracle
head) and a bad one (random head); a step is ``--batch`` concurrent requests of ``--max-tokens``
tokens. (1) One engine per fixed k (k = 0: an engine without speculation; k >= 1: started with
that k). (2) One adaptive engine (``spec.adaptive``, k_max = the largest k) running 4 rounds of an
adaptive block (``areal_npu.speculation.adaptive`` picks k each step; exploration and probes
included) followed by a block at each fixed k set at run time -- interleaved so that the slow
drifts of a shared machine hit all modes alike. Reported: tokens/s (wall clock over the mode's
steps), the median step, acceptance, and the adaptive ratio to the best k on the same engine and
to the best fixed engine. The model is wider than the tests' (``--width``): on a 2-layer,
128-wide model vLLM's per-step overhead hides what speculation saves.

    .venv/bin/python scripts/bench_rollout.py [--quick] [--head trained|oracle|random] [--json PATH]
    .venv/bin/python scripts/bench_rollout.py --adaptive [--quick] [--json PATH]
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

from areal_npu import names
from areal_npu.launch.engine_process import EngineProcess
from areal_npu.rollout.client import RolloutClient
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.acceptance import counter_delta, spec_stats
from areal_npu.speculation.config import SpecConfig


def build_trained(out: Path, steps: int, depths: int, layout: str) -> tuple[Path, list[list[int]], dict]:
    import torch
    from transformers import AutoTokenizer

    from areal_npu.model.layout import load_for_training, save_model_with_mtp
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model
    from areal_npu.testing.sft import evaluate_mtp, pattern_corpus, sft_warm_start

    torch.manual_seed(0)
    cfg = MTPConfig(enabled=True, num_depths=depths)
    init_cfg = TinyModelConfig(**dict(TEXT_FULL_ATTENTION, layout=layout))  # 2 full-attention layers, fp32
    init = save_tiny_model(out.parent / f"init-{layout}", init_cfg)
    model, mtp, checkpoint_layout = load_for_training(init, cfg)
    tokenizer = AutoTokenizer.from_pretrained(init)
    corpus = pattern_corpus(64, length=64, seed=0)
    batches = [corpus[i : i + 8] for i in range(0, len(corpus), 8)]
    start = time.perf_counter()
    history = sft_warm_start(model, mtp, batches, steps, cfg, log_every=max(steps, 1))
    evaluation = evaluate_mtp(model, mtp, batches[:2], num_depths=depths)
    path = save_model_with_mtp(model, mtp, out, tokenizer, layout=checkpoint_layout)
    prompts = [c[:16].tolist() for c in pattern_corpus(64, length=16, seed=1)]
    info = {
        "train_steps": steps,
        "train_seconds": round(time.perf_counter() - start, 1),
        "final": {k: round(v, 4) for k, v in history[-1].items() if isinstance(v, float)},
        "eval": {k: round(v, 4) for k, v in evaluation.items() if "acc" in k},
    }
    return path, prompts, info


def build_model(
    head: str, out: Path, steps: int, depths: int, layout: str = "text"
) -> tuple[str, Path, list[list[int]], dict]:
    rng = random.Random(0)
    byte_prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(64)]
    if head == "trained":
        cached = out / f"trained-{layout}-{steps}-{depths}.json"
        if cached.is_file():
            info = json.loads(cached.read_text())
            return "trained", Path(info.pop("path")), info.pop("prompts"), info
        try:
            path, prompts, info = build_trained(out / f"trained-{layout}-{steps}-{depths}", steps, depths, layout)
            cached.write_text(json.dumps({**info, "path": str(path), "prompts": prompts}))
            return "trained", path, prompts, info
        except Exception as exc:  # noqa: BLE001 - fall back, and say so
            print(f"[bench] trained head unavailable ({type(exc).__name__}: {exc}); using the oracle head")
            head = "oracle"
    from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model

    text = TinyModelConfig(**TEXT_FULL_ATTENTION)  # the float32 text model BENCHMARKS.md measured
    if head == "oracle":
        from areal_npu.testing.synthetic import save_aligned_model

        return "oracle", save_aligned_model(out / "oracle", text), byte_prompts, {}
    return "random", save_tiny_model(out / "random", text), byte_prompts, {}


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
    delta = counter_delta(before, after)
    stats = spec_stats(delta)
    return {
        "tokens_per_s": max(runs),
        "tokens_per_s_runs": [round(x, 1) for x in runs],
        "accept_rate": stats[names.SPEC_ACCEPT_RATE],
        "mean_accepted_len": stats[names.SPEC_MEAN_ACCEPTED_LEN],
        "accept_rate_per_pos": [
            round(stats[names.spec_accept_rate_pos_key(i)], 4) for i in range(len(delta.accepted_per_pos))
        ],
    }


def start_engine(model_dir: Path, k: int, work: Path, max_seqs: int, adaptive: bool = False) -> EngineProcess:
    spec = SpecConfig(method="mtp", num_speculative_tokens=k, adaptive=adaptive) if k else SpecConfig()
    cfg = RolloutConfig(model=str(model_dir), max_model_len=1024, spec=spec, log_dir=str(work / "logs"),
                        startup_timeout_s=900, extra_engine_args={"max_num_seqs": max_seqs})  # fmt: skip
    cfg.validate()
    engine = EngineProcess(cfg, index=k)
    t0 = time.perf_counter()
    engine.start()
    kind = "adaptive, k_max=" if adaptive else "k="
    print(f"[bench] {kind}{k}: engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    return engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer tokens and training steps (a few minutes)"
    )
    parser.add_argument("--head", choices=("trained", "oracle", "random"), default="trained")
    parser.add_argument(
        "--layout", choices=("auto", "text", "published"), default="auto",
        help="checkpoint layout of the trained head; auto: text where this vLLM serves Qwen3_5ForCausalLM "
        "(0.32), else the published multimodal layout (0.23)",
    )  # fmt: skip
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
    parser.add_argument("--adaptive", action="store_true", help="adaptive vs fixed k, good and bad drafter")
    parser.add_argument("--batch", type=int, default=2, help="--adaptive: concurrent requests per step")
    parser.add_argument("--steps", type=int, default=0, help="--adaptive: adaptive steps (default 80; 40 --quick)")
    parser.add_argument("--fixed-steps", type=int, default=0, help="--adaptive: steps per fixed k (default 20; 8)")
    parser.add_argument("--width", type=int, default=1024, help="--adaptive: hidden size of the model")
    args = parser.parse_args(argv)
    if args.adaptive:
        return adaptive_main(args)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    steps = args.train_steps or (40 if args.quick else 120)
    repeats = args.repeats or (2 if args.quick else 3)
    if 0 not in ks:
        ks = [0, *ks]

    from areal_npu.compat.vllm import features as vllm_version

    layout = args.layout
    if layout == "auto":
        layout = "text" if vllm_version.has("qwen3_5_text_class") else "published"
    if layout == "published" and args.head != "trained":
        parser.error("--layout published: only --head trained builds a published-layout checkpoint")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-rollout-"))
    head, model_dir, prompts, head_info = build_model(args.head, work, steps, depths=max(ks), layout=layout)
    print(f"[bench] head={head} layout={layout} model={model_dir} {json.dumps(head_info)}", flush=True)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir).get_text_config()
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
            "vllm": vllm_version.installed_version(),
            "layout": layout,
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


# ---- adaptive speculation ----------------------------------------------------------------------


def adaptive_models(work: Path, width: int) -> dict[str, Path]:
    from areal_npu.model.tiny import TinyModelConfig, save_tiny_model
    from areal_npu.testing.synthetic import save_aligned_model

    cfg = TinyModelConfig(hidden_size=width, intermediate_size=3 * width, num_hidden_layers=4,
                          num_attention_heads=max(4, width // 64), num_key_value_heads=max(2, width // 256),
                          head_dim=64, layout="text", linear_attention_every=0)  # fmt: skip
    return {
        # residual 0.01: a near-bigram backbone the MTP oracle follows (measured acceptance ~0.5 at k = 1)
        "good": save_aligned_model(work / f"good-{width}", cfg, residual_scale=0.01),
        "bad": save_tiny_model(work / f"bad-{width}", cfg),
    }


class Tally:
    """Tokens, seconds, per-step tokens/s and acceptance counters of one mode."""

    def __init__(self):
        self.tokens, self.seconds, self.drafted, self.accepted, self.steps = 0, 0.0, 0.0, 0.0, []

    def add(self, tokens: int, seconds: float, stats: dict) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.steps.append(tokens / seconds)
        self.drafted += stats[names.SPEC_DRAFT_TOKENS]
        self.accepted += stats[names.SPEC_ACCEPTED_TOKENS]

    def row(self) -> dict:
        from statistics import median

        return {
            "tokens_per_s": self.tokens / self.seconds,
            "median_step_tokens_per_s": median(self.steps),
            "accept_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "steps": len(self.steps),
        }


async def _one_step(client, prompts, max_tokens) -> tuple[int, float, dict]:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(client.generate(p, max_tokens=max_tokens, temperature=1.0, ignore_eos=True) for p in prompts)
    )
    seconds = time.perf_counter() - t0
    if any(r.failed for r in results):
        raise RuntimeError(next(r.error for r in results if r.failed))
    return sum(len(r.samples[0].output_ids) for r in results), seconds, await client.step_metrics()


async def fixed_engine_run(engine, steps: int, batch: int, max_tokens: int) -> dict:
    rng = random.Random(1)
    async with RolloutClient([engine], max_retries=0) as client:
        await asyncio.gather(*(client.generate([1, 2, 3], max_tokens=8) for _ in range(batch)))  # warm-up
        await client.step_metrics()
        tally = Tally()
        for _ in range(steps):
            prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(batch)]
            tally.add(*await _one_step(client, prompts, max_tokens))
    return tally.row()


async def interleaved_run(engine, rounds, adaptive_steps, fixed_steps, ks, batch, max_tokens, policy, log) -> dict:
    """Adaptive blocks and fixed-k blocks alternate on one engine, so slow drifts of a shared machine
    hit every mode alike. The driver sees only its own blocks; its k is restored before each."""
    from areal_npu.speculation.adaptive import AdaptiveSpecDriver

    rng = random.Random(1)
    tallies = {"adaptive": Tally(), **{f"k={k}": Tally() for k in ks}}
    ks_run: list[int] = []
    async with RolloutClient([engine], max_retries=0) as client:
        driver = AdaptiveSpecDriver(client, policy, log=log)
        await driver.start()
        await asyncio.gather(*(client.generate([1, 2, 3], max_tokens=8) for _ in range(batch)))  # warm-up
        step = 0
        for _ in range(rounds):
            await client.set_spec_k(driver.k)
            await client.step_metrics()
            for _ in range(adaptive_steps):
                prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(batch)]
                tokens, seconds, stats = await _one_step(client, prompts, max_tokens)
                tallies["adaptive"].add(tokens, seconds, stats)
                ks_run.append(int((await driver.step(step, stats))[names.SPEC_K]))
                step += 1
            for k in ks:
                await client.set_spec_k(k)
                await client.step_metrics()
                for _ in range(fixed_steps):
                    prompts = [[rng.randrange(256) for _ in range(12)] for _ in range(batch)]
                    tallies[f"k={k}"].add(*await _one_step(client, prompts, max_tokens))
    return {"tallies": {m: t.row() for m, t in tallies.items()}, "ks": ks_run}


def adaptive_main(args) -> int:
    from collections import Counter

    from areal_npu.speculation.policy import SpecAdaptConfig

    ks = sorted({0, *(int(k) for k in args.ks.split(","))})
    k_max = max(ks)
    rounds = 4
    adaptive_steps = (args.steps or (40 if args.quick else 80)) // rounds
    fixed_steps = (args.fixed_steps or (8 if args.quick else 20)) // rounds
    max_tokens = args.max_tokens or (32 if args.quick else 48)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-adaptive-"))
    models = adaptive_models(work, args.width)
    rows = []
    for head, model_dir in models.items():
        # 1) one engine per fixed k: what a user would otherwise run (k = 0: no drafter at all)
        for k in ks:
            engine = start_engine(model_dir, k, work, args.batch)
            try:
                row = asyncio.run(fixed_engine_run(engine, fixed_steps * rounds, args.batch, max_tokens))
            finally:
                engine.stop()
            rows.append({"head": head, "engine": "fixed", "mode": f"k={k}", **row})
            print(f"[bench] {head} fixed engine k={k}: {row['tokens_per_s']:.1f} tok/s", flush=True)
        # 2) the adaptive engine: adaptive blocks interleaved with fixed-k blocks
        engine = start_engine(model_dir, k_max, work, args.batch, adaptive=True)
        decisions: list[str] = []

        def log(line: str, decisions=decisions) -> None:
            decisions.append(line)
            print(line, flush=True)

        try:
            policy = SpecAdaptConfig(k_max=k_max)  # starts where the engine does (k_init: min(2, k_max))
            out = asyncio.run(interleaved_run(engine, rounds, adaptive_steps, fixed_steps, ks, args.batch,
                                              max_tokens, policy, log))  # fmt: skip
        finally:
            engine.stop()
        same = {m: r for m, r in out["tallies"].items() if m != "adaptive"}
        best_same = max(same, key=lambda m: same[m]["tokens_per_s"])
        fixed = {r["mode"]: r for r in rows if r["head"] == head and r["engine"] == "fixed"}
        best_fixed = max(fixed, key=lambda m: fixed[m]["tokens_per_s"])
        for mode, row in same.items():
            rows.append({"head": head, "engine": "adaptive", "mode": f"{mode} (set at run time)", **row})
        adaptive = out["tallies"]["adaptive"]
        adaptive.update(
            head=head, engine="adaptive", mode="adaptive", decisions=decisions,
            ratio_same_engine=adaptive["tokens_per_s"] / same[best_same]["tokens_per_s"], best_same=best_same,
            ratio_fixed_engines=adaptive["tokens_per_s"] / fixed[best_fixed]["tokens_per_s"], best_fixed=best_fixed,
            steps_at_k={str(k): n for k, n in sorted(Counter(out["ks"]).items())},
        )  # fmt: skip
        rows.append(adaptive)
        print(f"[bench] {head} adaptive: {adaptive['ratio_same_engine']:.3f} x best k on the same engine "
              f"({best_same}), {adaptive['ratio_fixed_engines']:.3f} x best fixed engine ({best_fixed})", flush=True)  # fmt: skip
    title = (f"adaptive vs fixed draft length (width {args.width}, batch {args.batch}, {max_tokens} tokens/request; "
             f"{rounds} rounds of {adaptive_steps} adaptive + {fixed_steps} steps per k on the adaptive engine)")  # fmt: skip
    print_adaptive_table(rows, title)
    if args.json:
        payload = {"bench": "adaptive", "width": args.width, "batch": args.batch, "max_tokens": max_tokens,
                   "rounds": rounds, "adaptive_steps_per_round": adaptive_steps,
                   "fixed_steps_per_round": fixed_steps, "quick": args.quick, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def print_adaptive_table(rows, title) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("drafter", "engine", "mode", "tok/s", "median step", "accept", "adaptive vs best", "steps at k"):
        table.add_column(col, justify="right")
    for r in rows:
        ratio = ""
        if r["mode"] == "adaptive":
            ratio = (f"{r['ratio_same_engine']:.3f}x ({r['best_same']}, same engine); "
                     f"{r['ratio_fixed_engines']:.3f}x ({r['best_fixed']} engine)")  # fmt: skip
        table.add_row(
            r["head"],
            r["engine"],
            r["mode"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['median_step_tokens_per_s']:.1f}",
            f"{r['accept_rate']:.2f}" if r["accept_rate"] else "-",
            ratio,
            " ".join(f"k{k}:{n}" for k, n in r.get("steps_at_k", {}).items()),
        )
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
