"""How much warm start on shell-agent demonstrations makes the tiny model's greedy turns well formed.

Not a test: a measurement (issue 16) whose numbers set ``warmstart`` in ``recipes/cpu/code_agent.yaml``
and the floor of ``tests/agent/test_demos.py``. For each learning rate and seed it builds the tiny
model, records the demonstrations of the first ``--n-demo`` training tasks (the real ShellAgent with a
scripted client, :mod:`areal_npu.agent.demos`), trains the run's engine with ``SFTLoss`` under the
warm start's optimizer (:func:`areal_npu.warmstart.warm_start`'s schedule, ``--steps``' last
value as its length) and, after each of ``--steps``, plays greedy episodes (transformers) on held-out
tasks. A turn is well formed when it has a reasoning line and exactly one ```bash block that
:func:`areal_npu.agent.actions.parse_action` accepts. Intermediate points see the learning rate not
yet decayed: they screen, the test confirms with ``warm_start`` itself.

    .venv/bin/python scripts/measure_demo_warmstart.py --steps 8,16,24 --lrs 4e-3,1e-2 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parses(text: str) -> bool:
    """The agent's own parser finds one command (mini-SWE-agent's lenient rule: a second ```bash
    opening can close the first block)."""
    from areal_npu.agent import actions

    return actions.parse_action(text).command is not None


def well_formed(text: str) -> bool:
    """Parses, with a reasoning line before the block, and the turn is just that: exactly two fences
    and nothing after the closing one (a turn that repeats its block until the token limit is not)."""
    reason, _, rest = text.partition("```bash")
    return parses(text) and bool(reason.strip()) and text.count("```") == 2 and rest.rstrip().endswith("```")


def first_turns(texts, stats) -> list[str]:
    out, i = [], 0
    for s in stats:
        out.append(texts[i])
        i += int(s["turns"])
    return out


def judge(texts, trajs) -> dict:
    stats = [t.meta["stats"] for t in trajs]
    ran = sum(s["turns"] - s["format_errors"] for s in stats)
    return {
        "well_formed": sum(map(well_formed, texts)) / max(len(texts), 1),
        "parses": sum(map(parses, texts)) / max(len(texts), 1),
        "turns": len(texts),
        "commands_ran": ran,
        "submitted": sum(s["submitted"] for s in stats) / len(stats),
        # the first turn edits (the demonstrations' first turn) rather than submitting at once
        "first_edits": sum(1 for t in first_turns(texts, stats) if "sed -i" in t) / len(stats),
        "reward": sum(s["reward"] for s in stats) / len(stats),
    }


def run_one(args, recipe, lr: float, seed: int, samples, held_out, work: Path) -> list[dict]:
    import torch

    from areal_npu import names
    from areal_npu.agent.demos import greedy_episodes
    from areal_npu.model.tiny import build_tokenizer, save_tiny_model
    from areal_npu.train.factory import build_engine
    from areal_npu.train.losses import SFTLoss
    from areal_npu.train.optim import OptimConfig

    steps = sorted(int(s) for s in args.steps.split(","))
    torch.manual_seed(seed)
    base = save_tiny_model(work / f"base{seed}", dataclasses.replace(recipe.model.tiny, seed=seed))
    total = steps[-1]
    optim = OptimConfig(lr=lr, warmup_steps=min(20, total // 10), schedule="cosine", total_steps=total + 1,
                        min_lr_ratio=0.1)  # fmt: skip
    train_cfg = dataclasses.replace(recipe.train, optim=optim, ppo_minibatches=1)
    tok = build_tokenizer()
    engine = build_engine(train_cfg, base, recipe.mtp, tok.pad_token_id)
    rng, rows, t0, train_s = random.Random(seed), [], time.perf_counter(), 0.0
    for step in range(1, total + 1):
        t = time.perf_counter()
        stats = engine.train_step(rng.sample(samples, min(args.batch_size, len(samples))), SFTLoss())
        train_s += time.perf_counter() - t
        print(
            f"  step {step}: nll {stats.get(names.SFT_NLL, float('nan')):.3f}, {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        if step in steps:
            out = engine.save_hf_checkpoint(work / f"ck{seed}", tok)
            t = time.perf_counter()
            texts, trajs = greedy_episodes(out, held_out, recipe.workflow, recipe.mtp)
            row = {"lr": lr, "seed": seed, "steps": step, "nll": stats.get(names.SFT_NLL), "train_s": train_s,
                   "eval_s": time.perf_counter() - t, **judge(texts, trajs)}  # fmt: skip
            print(json.dumps(row), flush=True)
            if args.show:
                print("\n---\n".join(texts[: args.show]), flush=True)
            rows.append(row)
    print(f"lr {lr} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/cpu/code_agent.yaml"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. workflow.max_turns=2")
    ap.add_argument("--steps", default="8,16,24", help="evaluate after these many SFT steps")
    ap.add_argument("--lrs", default="4e-3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-demo", type=int, default=16, help="demonstrations (the first training tasks)")
    ap.add_argument("--n-held", type=int, default=8, help="held-out tasks (the recipe's eval split)")
    ap.add_argument("--show", type=int, default=0, help="print this many greedy turns per evaluation")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: on a loaded machine, more spin)"
    )
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)

    from areal_npu.agent.demos import demo_samples
    from areal_npu.agent.tasks import make_splits
    from areal_npu.config import load_config
    from areal_npu.model.tiny import build_tokenizer
    from areal_npu.recipe import RLConfig
    from areal_npu.train.dist import init_distributed

    init_distributed()
    recipe = load_config(RLConfig, Path(args.recipe), args.overrides)
    train, held_out = make_splits(recipe.task)
    demo_issues = {t.problem_statement for t in train[: args.n_demo]}  # the same issue in another copy
    held_out = [t for t in held_out if t.problem_statement not in demo_issues][: args.n_held]
    t = time.perf_counter()
    samples = demo_samples(build_tokenizer(), train[: args.n_demo], recipe.workflow)
    lens = [len(s.input_ids) for s in samples]
    print(f"{len(samples)} demonstrations in {time.perf_counter() - t:.0f} s, {statistics.median(lens):.0f} "
          f"tokens median, {statistics.median(int(s.loss_mask.sum()) for s in samples):.0f} trained", flush=True)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for lr in (float(x) for x in args.lrs.split(",")):
            for seed in (int(x) for x in args.seeds.split(",")):
                rows += run_one(args, recipe, lr, seed, samples, held_out, Path(tmp))
    print(f"{'lr':>8} {'steps':>5} {'well-formed (per seed)':>28} {'median':>6} {'ran':>4} {'edits 1st':>9} "
          f"{'train s':>7}")  # fmt: skip
    for lr, steps in sorted({(r["lr"], r["steps"]) for r in rows}):
        sel = [r for r in rows if r["lr"] == lr and r["steps"] == steps]
        wf = [r["well_formed"] for r in sel]
        print(f"{lr:8.0e} {steps:5d} {' '.join(f'{w:.2f}' for w in wf):>28} {statistics.median(wf):6.2f} "
              f"{statistics.median(r['commands_ran'] for r in sel):4.0f} "
              f"{statistics.median(r['first_edits'] for r in sel):9.2f} "
              f"{statistics.median(r['train_s'] for r in sel):7.0f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
