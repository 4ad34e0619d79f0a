"""SFT warm start of the policy and its MTP head on packed micro-batches (CPU-friendly).

One step on a micro-batch of sequences ``x_j`` (with loss masks ``m_j``, default all ones):

    L = CE_next(policy) / N  +  L_mtp          (mode "joint")
    L = L_mtp                                  (mode "mtp_only": backbone frozen, run without grad)
    L = CE_next(policy) / N                    (mode "off" / "frozen")

``CE_next`` is next-token cross-entropy inside each packed segment over target tokens with
``m = 1``; ``L_mtp`` is :func:`areal_npu.model.mtp_loss.mtp_loss`. AdamW, gradient clipping.
Standalone (no train engine, no ``torch.distributed``): the MTP tests use it to train a head vLLM
then drafts from, ``scripts/bench_rollout.py`` for its trained drafter, ``scripts/bench_mtp.py`` for
the next-token loss. ``areal-npu train`` warm-starts through the train engine instead
(:mod:`areal_npu.warmstart`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from areal_npu import names
from areal_npu.data.packed_layout import PackedBatch, pack_per_token, pack_sequences
from areal_npu.model.mtp import MTPConfig, Qwen35MTP
from areal_npu.model.mtp_loss import backbone_forward, joint_forward
from areal_npu.model.mtp_params import apply_mtp_mode, mtp_mode
from areal_npu.model.mtp_targets import build_packed_mtp_targets
from areal_npu.model.packed import enable_packed_attention, packed_shift_labels

__all__ = ["PATTERN_TEXT", "evaluate_mtp", "next_token_loss", "pattern_corpus", "sft_warm_start"]

PATTERN_TEXT = (
    "the quick brown fox jumps over the lazy dog. "
    "pack my box with five dozen liquor jugs! "
    "1+1=2, 2+2=4, 3+3=6, 4+4=8, 5+5=10. "
    "sphinx of black quartz, judge my vow; "
)

Sample = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def pattern_corpus(
    num_sequences: int, length: int = 64, seed: int = 0, text: str = PATTERN_TEXT
) -> list[torch.Tensor]:
    """Deterministic, learnable byte sequences: windows of ``text`` repeated, at random offsets."""
    data = list(text.encode())
    rng = random.Random(seed)
    out = []
    for _ in range(num_sequences):
        start = rng.randrange(len(data))
        out.append(torch.tensor([data[(start + i) % len(data)] for i in range(length)], dtype=torch.long))
    return out


def next_token_loss(
    logits: torch.Tensor,
    batch: PackedBatch,
    loss_mask: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, int]:
    """``sum_t -log p(ids[t+1] | ids[<=t]) / N`` over in-segment targets with ``loss_mask[t+1]``."""
    ids = batch.input_ids
    carries = batch.valid_mask if loss_mask is None else batch.valid_mask & loss_mask
    labels = packed_shift_labels(torch.where(carries, ids, -100), batch.cu_seqlens)
    count = int((labels != -100).sum())
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=-100, reduction="sum"
    )
    return ce / max(num_tokens or count, 1), count


def _prepare(micro_batch: Sequence[Sample], num_depths: int, alignment: int):
    seqs = [s[0] if isinstance(s, tuple) else s for s in micro_batch]
    masks = [
        s[1].to(torch.bool) if isinstance(s, tuple) else torch.ones(len(s), dtype=torch.bool)
        for s in micro_batch
    ]
    batch = pack_sequences(seqs, alignment=alignment)
    targets = build_packed_mtp_targets(batch, num_depths, masks) if num_depths else None
    return batch, pack_per_token(masks, batch, False), targets


def sft_warm_start(
    model,
    mtp: Qwen35MTP | None,
    batches: Sequence[Sequence[Sample]],
    steps: int,
    mtp_cfg: MTPConfig | None = None,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    alignment: int = 1,
    log_every: int = 25,
    on_log: Callable[[dict], None] | None = None,
    seed: int = 0,
) -> list[dict]:
    """Train for ``steps`` optimizer steps, cycling over ``batches`` (each a micro-batch: 1-D token
    tensors, or ``(tokens, loss_mask)`` pairs). Mode from ``mtp_cfg`` (default: joint, 1 depth).
    Returns the logged rows (``step``, ``loss``, ``sft/loss``, ``mtp/loss_d{d}``, ``mtp/acc_d{d}``,
    ``sec``); the last row is the final step's."""
    cfg = mtp_cfg or MTPConfig(enabled=mtp is not None)
    mode = mtp_mode(cfg)
    if mode != "off" and mtp is None:
        raise ValueError(f"MTP mode {mode!r} needs an MTP head")
    torch.manual_seed(seed)
    enable_packed_attention(model)
    groups = apply_mtp_mode(model, mtp, cfg)
    optimizer = torch.optim.AdamW(groups.optimizer_groups(lr), lr=lr, weight_decay=weight_decay)
    # Clipped per group: a joint clip would let the head's gradient rescale the policy's update.
    param_lists = [g["params"] for g in optimizer.param_groups]
    use_mtp = mode in ("joint", "mtp_only")
    prepared = [_prepare(mb, cfg.num_depths if use_mtp else 0, alignment) for mb in batches]
    model.train()
    if mtp is not None:
        mtp.train(use_mtp)
    history: list[dict] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch, loss_mask, targets = prepared[(step - 1) % len(prepared)]
        row: dict = {"step": step}
        if use_mtp:
            out = joint_forward(
                model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen,
                loss_scale=cfg.loss_scale, freeze_backbone=mode == "mtp_only",
            )  # fmt: skip
            logits, loss = out.logits, out.mtp_loss
            row.update(out.stats)
            if mode == "mtp_only":
                # The loss_scale only weighs the head against the policy; alone it would just shrink the lr.
                loss = loss / max(cfg.loss_scale, 1e-12)
        else:
            cu = batch.cu_seqlens.to(torch.int32)
            logits, _ = backbone_forward(
                model, input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen,
                use_cache=False,
            )  # fmt: skip
            loss = None
        if mode != "mtp_only":
            sft, _ = next_token_loss(logits, batch, loss_mask)
            row[names.SFT_LOSS] = float(sft.detach())
            loss = sft if loss is None else sft + loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            for plist in param_lists:
                torch.nn.utils.clip_grad_norm_(plist, grad_clip)
        optimizer.step()
        row["loss"] = float(loss.detach())
        if step % log_every == 0 or step == steps:
            row["sec"] = time.perf_counter() - start
            history.append(row)
            if on_log is not None:
                on_log(row)
    model.eval()
    if mtp is not None:
        mtp.eval()
    return history


@torch.no_grad()
def evaluate_mtp(
    model, mtp: Qwen35MTP, batches: Sequence[Sequence[Sample]], num_depths: int = 1, alignment: int = 1
) -> dict[str, float]:
    """``mtp/loss_d{d}`` and ``mtp/acc_d{d}`` over all ``batches``, normalised by the global per-depth
    token counts (so micro-batch values add up), without changing any weight."""
    enable_packed_attention(model)
    prepared = [_prepare(mb, num_depths, alignment) for mb in batches]
    counts = [sum(t.valid_counts()[d] for _, _, t in prepared) for d in range(num_depths)]
    was_training = model.training, mtp.training
    model.eval()
    mtp.eval()
    totals: dict[str, float] = {}
    for batch, _, targets in prepared:
        out = joint_forward(
            model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen,
            loss_scale=1.0, num_valid_tokens=counts,
        )  # fmt: skip
        for key, value in out.stats.items():
            if key.startswith(names.MTP_STAT_PREFIXES):
                totals[key] = totals.get(key, 0.0) + value
    model.train(was_training[0])
    mtp.train(was_training[1])
    return totals
