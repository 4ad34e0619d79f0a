"""Which CUDA path packed attention takes for a layout: one varlen call or one SDPA call per segment.

A pure function of the layout (segment lengths, head counts, head dim, whether the varlen kernel
takes GQA natively), from a cost model fitted to the H200 measurements in docs/BENCHMARKS.md
("On an NVIDIA H200", docs/bench/attention_h200.json: 65,536 tokens, 16 query / 4 KV heads,
d = 128, bf16, forward + backward, torch 2.11 ``varlen_attn``):

    per-segment SDPA:  PER_SEGMENT_MS * S + SDPA_MS_PER_MSQ * sum(s_j^2) / 1e6 * w
    varlen:            VARLEN_MS_PER_TOKEN * T * w + VARLEN_MS_PER_MSQ * sum(s_j^2) / 1e6 * w

with ``S`` segments of lengths ``s_j``, ``T = sum(s_j)`` and ``w = Hq * d / (16 * 128)`` (the work
of both kernels grows with query heads times head dim; the per-call launch cost does not). Each
pair of coefficients is solved exactly from the two measured layouts (82 segments of 83-1458
tokens, sum s^2 = 64.7 M; 8 segments of 8192, sum s^2 = 536.9 M):

    per-segment 53.5 / 19.6 ms; varlen over strided head groups 8.0 / 28.8 ms; one varlen call with
    KV repeated (the cost stand-in for a native-GQA call: flash-attn, torch >= 2.13) 5.8 / 25.6 ms.

Both layouts had the same ``T``, so the varlen path's fixed cost is attributed to tokens (an
assumption). Crossover for equal segments: ~4.2K tokens with head groups, ~5.1K with one call.
An earlier H200 run (docs REFERENCES: 84 segments 48.9 / 6.5 ms, 8 segments 24 / 33 ms) agrees
with the model's choice on both layouts. Nothing here is measured on other GPUs or head configs.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MEASURED_HEAD_WORK",
    "PER_SEGMENT",
    "VARLEN",
    "cuda_attention_path",
    "predicted_cuda_ms",
]

PER_SEGMENT = "per_segment"
VARLEN = "varlen"

MEASURED_HEAD_WORK = 16 * 128  # query heads x head dim of the measurement
PER_SEGMENT_MS = 0.6314  # launch + bookkeeping per SDPA call pair (fwd + bwd)
SDPA_MS_PER_MSQ = 0.02713  # per million s^2 score entries
VARLEN_GROUPS_MS_PER_TOKEN = 5.163 / 65536  # strided head groups (torch < 2.13, Hq > Hkv)
VARLEN_GROUPS_MS_PER_MSQ = 0.04404
VARLEN_ONE_CALL_MS_PER_TOKEN = 3.088 / 65536  # one call over all heads
VARLEN_ONE_CALL_MS_PER_MSQ = 0.04198


def predicted_cuda_ms(
    lengths: Sequence[int], q_heads: int, kv_heads: int, head_dim: int, native_gqa: bool
) -> dict[str, float]:
    """Predicted fwd+bwd milliseconds of each path (H200, bf16) for one layout."""
    lengths = [int(s) for s in lengths if s > 0]
    tokens = sum(lengths)
    msq = sum(s * s for s in lengths) / 1e6
    w = q_heads * head_dim / MEASURED_HEAD_WORK
    grouped = q_heads != kv_heads and not native_gqa
    per_token = VARLEN_GROUPS_MS_PER_TOKEN if grouped else VARLEN_ONE_CALL_MS_PER_TOKEN
    per_msq = VARLEN_GROUPS_MS_PER_MSQ if grouped else VARLEN_ONE_CALL_MS_PER_MSQ
    return {
        PER_SEGMENT: PER_SEGMENT_MS * len(lengths) + SDPA_MS_PER_MSQ * msq * w,
        VARLEN: (per_token * tokens + per_msq * msq) * w,
    }


def cuda_attention_path(
    lengths: Sequence[int], q_heads: int, kv_heads: int, head_dim: int, native_gqa: bool
) -> str:
    """``"varlen"`` or ``"per_segment"``: the path the model above predicts faster (ties: varlen)."""
    ms = predicted_cuda_ms(lengths, q_heads, kv_heads, head_dim, native_gqa)
    return PER_SEGMENT if ms[PER_SEGMENT] < ms[VARLEN] else VARLEN
