"""Step-time overhead of joint MTP training vs none, side by side in one process (tiny Qwen3.5).

One step = packed forward + policy next-token loss (+ MTP loss) + backward + AdamW step. The
variants are timed interleaved (none, mtp d=1, mtp d=2, none, ...) so machine load hits them alike;
the table shows medians and the ratio to "none".

    python scripts/bench_mtp.py [--quick] [--json PATH] [--repeats N] [--tokens T] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from areal_npu.data.packed_layout import pack_per_token, pack_sequences
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.mtp_loss import backbone_forward, joint_forward
from areal_npu.model.mtp_params import apply_mtp_mode
from areal_npu.model.mtp_targets import build_packed_mtp_targets
from areal_npu.model.packed import enable_packed_attention
from areal_npu.model.tiny import TinyModelConfig, build_tiny_model
from areal_npu.testing.sft import next_token_loss

TARGET = 1.25
SHAPES = {
    # (layers, linear_attention_every): Qwen3.6's 3:1 hybrid in small, and a 2-layer full-attention toy
    "hybrid-8L": (8, 4),
    "full-2L": (2, 0),
}


def make_step(shape: str, depths: int, tokens: int, seed: int = 0):
    layers, every = SHAPES[shape]
    # the text layout with GDN head dim = head_dim: the shapes BENCHMARKS.md's numbers were measured on
    cfg = TinyModelConfig(num_hidden_layers=layers, linear_attention_every=every, seed=seed, layout="text",
                          linear_head_dim=0)  # fmt: skip
    model, mtp, _ = build_tiny_model(cfg)
    enable_packed_attention(model)
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(tokens // 8, tokens // 2 + 1, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    masks = [torch.arange(n) >= n // 4 for n in lengths]  # prompt quarter carries no loss
    batch = pack_sequences(seqs, alignment=8)
    loss_mask = pack_per_token(masks, batch, False)
    mtp_cfg = MTPConfig(enabled=depths > 0, num_depths=max(depths, 1))
    groups = apply_mtp_mode(model, mtp if depths else None, mtp_cfg)
    opt = torch.optim.AdamW(groups.optimizer_groups(1e-4), lr=1e-4)
    targets = build_packed_mtp_targets(batch, depths, masks) if depths else None
    cu = batch.cu_seqlens

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if depths:
            out = joint_forward(
                model, mtp, targets, batch.input_ids, batch.position_ids, cu, batch.max_seqlen
            )
            logits, extra = out.logits, out.mtp_loss
        else:
            logits, _ = backbone_forward(
                model, input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen,
                max_length_k=batch.max_seqlen, use_cache=False,
            )  # fmt: skip
            extra = None
        loss, _ = next_token_loss(logits[0], batch, loss_mask)
        (loss if extra is None else loss + extra).backward()
        opt.step()

    return step


def run(shapes: list[str], tokens: int, repeats: int, warmup: int) -> list[dict]:
    rows = []
    for shape in shapes:
        variants = {"none": make_step(shape, 0, tokens), "mtp d=1": make_step(shape, 1, tokens),
                    "mtp d=2": make_step(shape, 2, tokens)}  # fmt: skip
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["none"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append({"shape": shape, "variant": name, "tokens": tokens, "repeats": repeats,
                         "median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "ratio": med / base})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (CI smoke)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=None, help="tokens per packed micro-batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: least sensitive to co-tenant load)"
    )
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = args.tokens or (256 if args.quick else 1024)
    repeats = args.repeats or (3 if args.quick else 9)
    torch.manual_seed(0)
    rows = run(args.shapes, tokens, repeats, warmup=1 if args.quick else 2)

    table = Table(title=f"MTP joint-training step overhead ({tokens} packed tokens, median of {repeats})")
    for col in ("shape", "variant", "median ms", "min ms", "x none", f"<= {TARGET}x"):
        table.add_column(col, justify="right" if col not in ("shape", "variant") else "left")
    for r in rows:
        ok = "" if r["variant"] == "none" else ("yes" if r["ratio"] <= TARGET else "NO")
        table.add_row(
            r["shape"], r["variant"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}", f"{r['ratio']:.3f}", ok
        )
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_ratio": TARGET, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
