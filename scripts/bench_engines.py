#!/usr/bin/env python
"""The two train engines side by side: FSDP2 (:class:`areal_npu.train.fsdp2.FSDPEngine`) and
Megatron-Core (:class:`areal_npu.train.megatron.engine.MegatronEngine`, tp = 1), one process, one
gloo rank, float32, the same tiny Qwen3 text model and the same packed PPO batch.

Per engine: ``compute_logprobs`` time and one PPO ``train_step`` time (``ppo_minibatches`` = 1:
packed forward + decoupled PPO loss (+ the MTP loss with ``--mtp``) + backward + clip + AdamW),
medians over ``--repeats`` after a warm-up, the two engines timed interleaved (fsdp2, megatron,
fsdp2, ...) so machine load hits them alike; tokens/s of both; the peak resident-set growth over
one logprobs + step after the warm-up (Linux ``VmHWM`` reset through ``/proc/self/clear_refs``);
and the ratio Megatron / FSDP2. A sanity row: both engines start from the same weights, so the
first step's log-probs, PPO loss and gradient norm (and MTP loss) must agree up to float32
reduction order -- the engines are meant to compute the same function. ``--tp 2`` adds Megatron at
tp = 2 on two spawned gloo ranks (one thread each), timed alone after the pair, with the same
sanity row against FSDP2 (its peak RSS: rank 0's).

Usage:  python scripts/bench_engines.py [--quick] [--json PATH] [--mtp] [--repeats N] [--threads N] [--tp 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import time

import torch

from areal_npu import names

MB = 1024 * 1024
# (hidden, intermediate, layers, heads, kv heads, head dim, vocab, samples, min len, max len, tokens/mb)
SHAPES = {
    "full": (512, 1408, 4, 8, 4, 64, 32768, 8, 96, 416, 1024),
    "quick": (128, 352, 2, 4, 2, 32, 4096, 6, 24, 96, 192),
}


def build_model(shape: str, seed: int = 3):
    """(HF config, float32 Qwen3ForCausalLM) with norms perturbed away from 1 (as the tests' tiny Qwen3)."""
    from transformers import Qwen3Config

    from areal_npu.testing.dense import perturbed_qwen3

    h, inter, layers, heads, kv, hd, vocab, *_ = SHAPES[shape]
    config = Qwen3Config(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-6,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"})  # fmt: skip
    return config, perturbed_qwen3(config, seed)


def build_head(config):
    from areal_npu.model.mtp import Qwen35MTP, init_mtp_weights

    head = Qwen35MTP(config, 1)
    init_mtp_weights(head, std=0.02, generator=torch.Generator().manual_seed(11))
    return head


def make_samples(shape: str, seed: int = 0):
    """A PPO batch of variable-length samples (prompt quarter, response with loss, behaviour log-probs)."""
    from areal_npu.data.sample import TrainSample

    *_, vocab, n, lo, hi, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompt = length // 4
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.arange(length) >= prompt
        behave = torch.where(
            mask, -math.log(vocab) + 0.3 * torch.randn(length, generator=g), torch.zeros(length)
        )
        versions = torch.where(mask, torch.zeros(length, dtype=torch.long), torch.full((length,), -1))
        advantage = torch.tensor(float(torch.randn((), generator=g)))
        samples.append(TrainSample(input_ids=ids, loss_mask=mask, behave_logp=behave, versions=versions,
                                   advantage=advantage))  # fmt: skip
    return samples


def build_engines(shape: str, mtp: bool, names=("fsdp2", "megatron"), tp: int = 1) -> dict:
    """The engines named (``fsdp2``, ``megatron``) from the same weights; Megatron at ``tp``."""
    from areal_npu.data.packing import PackingConfig
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.train.config import MegatronLayoutConfig, TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.megatron.engine import MegatronEngine
    from areal_npu.train.optim import OptimConfig

    config, hf = build_model(shape)
    head = build_head(config) if mtp else None
    mtp_cfg = MTPConfig(enabled=mtp, train=mtp, num_depths=1, loss_scale=0.3, lr_scale=0.5)
    common = dict(
        packing=PackingConfig(max_tokens_per_mb=SHAPES[shape][-1]), optim=OptimConfig(lr=1e-4, eps=1e-3)
    )
    engines = {}
    if "fsdp2" in names:
        engines["fsdp2"] = FSDPEngine(copy.deepcopy(hf), copy.deepcopy(head), TrainEngineConfig(**common),
                                      mtp_config=copy.deepcopy(mtp_cfg))  # fmt: skip
    if "megatron" in names:
        cfg = TrainEngineConfig(backend="megatron", megatron=MegatronLayoutConfig(tp_size=tp), **common)
        kwargs = dict(mtp=head, mtp_config=copy.deepcopy(mtp_cfg)) if mtp else {}
        engines["megatron" if tp == 1 else f"megatron tp={tp}"] = MegatronEngine.from_hf_model(
            hf, cfg, **kwargs
        )
    return engines


def ppo_step(engine, samples):
    from areal_npu.train.losses import PPOLoss

    return engine.train_step(samples, PPOLoss())


def with_prox(samples, logps):
    out = copy.deepcopy(samples)
    for s, lp in zip(out, logps):
        s.prox_logp = lp
    return out


def measure(engines: dict, samples, repeats: int, warmup: int) -> dict:
    """Per engine: the first logprobs + step (sanity), peak RSS growth over one more, then
    ``repeats`` timed logprobs + steps, the engines interleaved."""
    from areal_npu.testing.memory import reset_peak_rss, status_bytes

    first = {}
    for name, engine in engines.items():
        logps = engine.compute_logprobs(samples)
        first[name] = {"logps": logps, "stats": ppo_step(engine, with_prox(samples, logps))}
    batch = {name: with_prox(samples, first[name]["logps"]) for name in engines}
    for _ in range(warmup - 1):
        for name, engine in engines.items():
            engine.compute_logprobs(samples)
            ppo_step(engine, batch[name])
    peak = {}
    for name, engine in engines.items():
        base = status_bytes("VmRSS")
        if reset_peak_rss():
            engine.compute_logprobs(samples)
            ppo_step(engine, batch[name])
            peak[name] = (status_bytes("VmHWM") - base) / MB
    times = {name: {"logprobs": [], "step": []} for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.compute_logprobs(samples)
            t1 = time.perf_counter()
            ppo_step(engine, batch[name])
            t2 = time.perf_counter()
            times[name]["logprobs"].append(t1 - t0)
            times[name]["step"].append(t2 - t1)
    return {name: dict(first[name], times=times[name], peak_rss_mb=peak.get(name)) for name in engines}


def summarise(measured: dict, samples, shape: str, mtp: bool, repeats: int) -> dict:
    """Medians, tokens/s, and per engine its ratio to FSDP2 and its first step's difference from it."""
    tokens = sum(len(s) for s in samples)
    rows, ratio, sanity = {}, {}, {}
    for name, m in measured.items():
        lp, st = statistics.median(m["times"]["logprobs"]), statistics.median(m["times"]["step"])
        rows[name] = {"logprobs_ms": lp * 1e3, "step_ms": st * 1e3, "logprobs_tok_s": tokens / lp,
                      "step_tok_s": tokens / st, "peak_rss_mb": m["peak_rss_mb"], "logprobs_all_ms":
                      [t * 1e3 for t in m["times"]["logprobs"]], "step_all_ms": [t * 1e3 for t in m["times"]["step"]]}  # fmt: skip
    f, sf = rows["fsdp2"], measured["fsdp2"]
    for name, r in rows.items():
        if name == "fsdp2":
            continue
        ratio[name] = {"logprobs": r["logprobs_ms"] / f["logprobs_ms"], "step": r["step_ms"] / f["step_ms"]}
        if (
            min(f["peak_rss_mb"] or 0, r["peak_rss_mb"] or 0) > 1
        ):  # a ratio of noise-sized growths says nothing
            ratio[name]["peak_rss"] = r["peak_rss_mb"] / f["peak_rss_mb"]
        lm, sm = measured[name]["logps"], measured[name]["stats"]
        diff = {"logp_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(sf["logps"], lm))}
        for key in (names.PPO_LOSS, names.TRAIN_GRAD_NORM, names.MTP_LOSS):
            if key in sf["stats"]:
                a, b = sf["stats"][key], sm[key]
                diff[key + " rel diff"] = abs(b - a) / max(abs(a), 1e-30)
                diff[key] = {"fsdp2": a, name: b}
        sanity[name] = diff
    return {"shape": shape, "mtp": mtp, "tokens": tokens, "lengths": [len(s) for s in samples],
            "repeats": repeats, "engines": rows, "ratio": ratio, "sanity": sanity}  # fmt: skip


def _tp_worker(
    rank: int, tp: int, init_file: str, out: str, shape: str, mtp: bool, repeats: int, warmup: int
):
    """One rank of the Megatron engine at ``tp`` (its own process, one thread); rank 0 writes the measurements."""
    from areal_npu.train.dist import process_group

    torch.set_num_threads(1)
    with process_group(rank, tp, f"file://{init_file}"):
        engines = build_engines(shape, mtp, ("megatron",), tp)
        measured = measure(engines, make_samples(shape), repeats, warmup)
    if rank == 0:
        torch.save(measured, out)


def measure_tp(tp: int, shape: str, mtp: bool, repeats: int, warmup: int) -> dict:
    """The Megatron engine at ``tp`` on ``tp`` spawned gloo ranks (timed alone, after the others)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tp.pt")
        args = (tp, os.path.join(tmp, "rdv"), out, shape, mtp, repeats, warmup)
        mp.start_processes(_tp_worker, args=args, nprocs=tp, join=True, start_method="spawn")
        return torch.load(out, weights_only=False)


def print_table(result: dict, threads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    h, inter, layers, heads, kv, hd, vocab, *_ = SHAPES[result["shape"]]
    title = (f"train engines side by side: Qwen3 h={h} ffn={inter} L={layers} heads={heads}/{kv} V={vocab}"
             f"{' + MTP d=1' if result['mtp'] else ''}; {len(result['lengths'])} samples, {result['tokens']} "
             f"tokens; float32, 1 gloo rank, threads={threads}; median of {result['repeats']}"
             f"{'; tp>1 rows: 1 thread per rank, timed after the pair' if len(result['engines']) > 2 else ''}")  # fmt: skip
    table = Table(title=title)
    for col in ("engine", "logprobs ms", "logprobs tok/s", "PPO step ms", "step tok/s", "peak RSS +MB"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in result["engines"].items():
        rss = f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] is not None else "-"
        table.add_row(name, f"{r['logprobs_ms']:.0f}", f"{r['logprobs_tok_s']:.0f}", f"{r['step_ms']:.0f}",
                      f"{r['step_tok_s']:.0f}", rss)  # fmt: skip
    for name, ratio in result["ratio"].items():
        rss = f"{ratio['peak_rss']:.2f}x" if "peak_rss" in ratio else "-"
        table.add_row(f"{name} / fsdp2", f"{ratio['logprobs']:.2f}x", "", f"{ratio['step']:.2f}x", "", rss)
    console = Console(width=200)
    console.print(table)
    for name, s in result["sanity"].items():
        parts = [f"max |logp diff| {s['logp_max_abs_diff']:.1e}"]
        parts += [f"{k} {v:.1e}" for k, v in s.items() if k.endswith("rel diff")]
        console.print(f"sanity, {name} vs fsdp2, first step from the same weights: " + ", ".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and batch (CI smoke)")
    ap.add_argument("--mtp", action="store_true", help="train an MTP head (depth 1) jointly in both engines")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 5, quick 2)")
    ap.add_argument(
        "--warmup", type=int, default=2, help="untimed logprobs + steps first (the first checks sanity)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: least sensitive to load)"
    )
    ap.add_argument(
        "--tp", type=int, default=1, help="also Megatron at this tp on as many spawned gloo ranks"
    )
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from areal_npu.train.dist import process_group

    shape = "quick" if args.quick else "full"
    repeats = args.repeats or (2 if args.quick else 5)
    load_before = os.getloadavg()  # co-tenant load: the ratios are side by side, absolute times are not
    warmup = max(args.warmup, 1)
    samples = make_samples(shape)
    with process_group(0, 1):
        measured = measure(build_engines(shape, args.mtp), samples, repeats, warmup)
    if args.tp > 1:  # timed alone, after the side-by-side pair (not interleaved with it)
        measured[f"megatron tp={args.tp}"] = measure_tp(args.tp, shape, args.mtp, repeats, warmup)[
            f"megatron tp={args.tp}"
        ]
    result = summarise(measured, samples, shape, args.mtp, repeats)
    print_table(result, args.threads)
    if args.json:
        meta = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                "cpu_count": os.cpu_count(), "threads": args.threads, "loadavg_before": load_before,
                "loadavg_after": os.getloadavg()}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "result": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
