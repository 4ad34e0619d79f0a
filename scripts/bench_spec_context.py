"""MTP acceptance by context length: a tiny model and its MTP head trained on short sequences only,
then evaluated on long ones, acceptance measured per context-length bin (the effect vLLM-Ascend
reports at long context, its issues #10495 / #10118, reproduced in small on the CPU).

Training (:func:`areal_npu.testing.sft.sft_warm_start`, windows of a noisy text pattern): by default
the policy alone on ``--policy-len`` (= ``--eval-len``) tokens, so it holds at long context, then the MTP
head alone (2 depths, one shared layer as vLLM serves it; frozen policy) on ``--train-len`` tokens;
``--policy-len 0`` trains both jointly on ``--train-len`` (the policy then fails at long context too).
Evaluation:
sequences of ``--eval-len`` tokens, teacher-forced; at each position t the drafter's depth-d
distribution ``q_d`` (for token t+1+d) meets the policy's ``p`` at t+d, and with rejection sampling
(temperature 1) draft d is accepted with probability ``alpha_d(t) = sum_v min(p(v), q_d(v))``
(exact for d = 1 given the prefix; for d = 2 the prefix holds the data token where the drafter's
accepted one would be). Per bin of context length: mean ``alpha_1``, ``u_1 = E[alpha_1 * alpha_2]``
(both drafts accepted), the greedy match rate of draft 1, and the policy's own next-token accuracy.

    python scripts/bench_spec_context.py [--quick] [--json PATH] [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from areal_npu.model.mtp import MTPConfig, mtp_logits
from areal_npu.model.mtp_loss import joint_forward
from areal_npu.model.mtp_targets import build_mtp_targets
from areal_npu.model.packed import enable_packed_attention
from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, build_tiny_model
from areal_npu.testing.sft import PATTERN_TEXT, sft_warm_start


def noisy_pattern(num: int, length: int, seed: int, noise: float = 0.1) -> list[torch.Tensor]:
    """Windows of the pattern text at random offsets; each byte replaced by a random letter with
    probability ``noise`` (so neither policy nor drafter is certain)."""
    data = list(PATTERN_TEXT.encode())
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        start = rng.randrange(len(data))
        seq = [data[(start + i) % len(data)] for i in range(length)]
        seq = [rng.randrange(97, 123) if rng.random() < noise else b for b in seq]
        out.append(torch.tensor(seq, dtype=torch.long))
    return out


def bins_for(train_len: int, eval_len: int) -> list[tuple[int, int]]:
    """Context bins [lo, hi): the trained range, then x4 each until ``eval_len``."""
    edges, hi = [0, train_len], train_len
    while hi * 4 <= eval_len:
        hi *= 4
        edges.append(hi)
    if edges[-1] < eval_len:
        edges.append(eval_len)
    return list(zip(edges[:-1], edges[1:], strict=True))


@torch.no_grad()
def acceptance_by_position(model, mtp, seq: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position t (context t + 1 tokens): alpha_1, alpha_1 * alpha_2, greedy match, policy hit."""
    n = len(seq)
    ids = seq[None]
    pos = torch.arange(n)[None]
    targets = build_mtp_targets(ids, 2)
    out = joint_forward(model, mtp, targets, ids, pos, loss_scale=1.0)
    w = model.get_output_embeddings().weight
    p = torch.softmax(out.logits[0].float(), -1)  # p[t]: policy's law of token t+1
    q1 = torch.softmax(mtp_logits(out.mtp_hidden[0][0], w), -1)  # q1[t]: token t+2
    q2 = torch.softmax(mtp_logits(out.mtp_hidden[1][0], w), -1)  # q2[t]: token t+3
    m = n - 3  # positions with both targets inside the sequence
    a1 = torch.minimum(p[1 : m + 1], q1[:m]).sum(-1)
    a2 = torch.minimum(p[2 : m + 2], q2[:m]).sum(-1)
    greedy = (p[1 : m + 1].argmax(-1) == q1[:m].argmax(-1)).float()
    policy_hit = (p[:m].argmax(-1) == seq[1 : m + 1]).float()
    return {"alpha1": a1, "u1": a1 * a2, "greedy1": greedy, "policy_acc": policy_hit}


def _batches(num: int, length: int, seed: int, tokens: int = 1024) -> list[list[torch.Tensor]]:
    per = max(tokens // length, 1)
    corpus = noisy_pattern(num * per, length, seed)
    return [corpus[i : i + per] for i in range(0, len(corpus), per)]


def run(train_len: int, eval_len: int, steps: int, n_eval: int, policy_len: int = 0, seed: int = 0) -> dict:
    """``policy_len`` 0: policy and head trained jointly on ``train_len`` tokens; else the policy alone
    on ``policy_len``-token sequences first, then the head alone (frozen policy) on ``train_len``."""
    cfg = TinyModelConfig(**TEXT_FULL_ATTENTION, max_position_embeddings=max(eval_len, 4096), seed=seed)
    model, mtp, _ = build_tiny_model(cfg)
    enable_packed_attention(model)
    start = time.perf_counter()
    if policy_len:
        policy_steps = max(steps * 1024 // policy_len, 1)  # as many tokens as the head's training
        sft_warm_start(model, None, _batches(policy_steps, policy_len, seed + 2, tokens=policy_len), policy_steps,
                       MTPConfig(enabled=False), log_every=policy_steps)  # fmt: skip
        head_cfg = MTPConfig(enabled=True, num_depths=2, mtp_only=True)
    else:
        head_cfg = MTPConfig(enabled=True, num_depths=2)
    hist = sft_warm_start(model, mtp, _batches(steps, train_len, seed), steps, head_cfg, log_every=steps)
    train_s = time.perf_counter() - start
    bins = bins_for(train_len, eval_len)
    per_seq: dict[tuple[int, int], dict[str, list[float]]] = {b: {} for b in bins}
    for seq in noisy_pattern(n_eval, eval_len, seed + 1):
        stats = acceptance_by_position(model, mtp, seq)
        for lo, hi in bins:
            sl = slice(max(lo - 1, 0), hi - 1)  # index t sees t + 1 tokens of context
            for key, values in stats.items():
                per_seq[(lo, hi)].setdefault(key, []).append(float(values[sl].mean()))
    rows = []
    for lo, hi in bins:
        row = {"ctx_lo": lo, "ctx_hi": hi}
        row.update({key: statistics.median(v) for key, v in per_seq[(lo, hi)].items()})
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["alpha1_ratio"] = row["alpha1"] / base["alpha1"] if base["alpha1"] else 0.0
        row["u1_ratio"] = row["u1"] / base["u1"] if base["u1"] else 0.0
    return {"train_len": train_len, "policy_len": policy_len, "eval_len": eval_len, "steps": steps, "n_eval": n_eval,
            "train_s": train_s, "final_loss": hist[-1]["loss"], "rows": rows}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter training and contexts (CI smoke)")
    parser.add_argument("--train-len", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--eval-len", type=int, default=None, help="tokens per evaluation sequence")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (1024 tokens each)")
    parser.add_argument(
        "--policy-len", type=int, default=None,
        help="train the policy alone on sequences this long first, then the head alone on --train-len "
        "(isolates the drafter; 0: both jointly on --train-len; default: --eval-len)",
    )  # fmt: skip
    parser.add_argument("--n-eval", type=int, default=None, help="evaluation sequences (medians over them)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--json", help="write the result as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eval_len = args.eval_len or (1024 if args.quick else 4096)
    steps = args.steps or (60 if args.quick else 400)
    n_eval = args.n_eval or (3 if args.quick else 7)
    policy_len = eval_len if args.policy_len is None else args.policy_len
    result = run(args.train_len, eval_len, steps, n_eval, policy_len)
    policy = f"policy on {policy_len}, head alone" if policy_len else "policy and head jointly"
    table = Table(
        title=f"MTP acceptance by context ({policy} on {args.train_len}-token sequences, {steps} steps; "
        f"median over {n_eval} sequences of {eval_len})"
    )
    for col in ("context", "alpha_1", "x trained", "u_1 (both)", "x trained", "greedy match", "policy acc"):
        table.add_column(col, justify="left" if col == "context" else "right")
    for r in result["rows"]:
        table.add_row(
            f"[{r['ctx_lo']}, {r['ctx_hi']})", f"{r['alpha1']:.3f}", f"{r['alpha1_ratio']:.3f}",
            f"{r['u1']:.3f}", f"{r['u1_ratio']:.3f}", f"{r['greedy1']:.3f}", f"{r['policy_acc']:.3f}",
        )  # fmt: skip
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
