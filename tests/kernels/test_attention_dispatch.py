"""CUDA packed attention by layout: the pure dispatch rule, and both paths against a naive loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from areal_npu.kernels import attention_dispatch as ad
from areal_npu.kernels import packed_attention as pa

H200_JSON = Path(__file__).resolve().parents[2] / "docs" / "bench" / "attention_h200.json"


def naive_per_segment(q, k, v, cu, scale=None):
    """Explicit float64 softmax(q k^T) v per segment and query head, causal; GQA by h // (Hq/Hkv)."""
    t, hq, d = q.shape
    rep = hq // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:]):
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        for h in range(hq):
            qs, ks, vs = q[a:b, h].double(), k[a:b, h // rep].double(), v[a:b, h // rep].double()
            scores = (qs @ ks.T * scale).masked_fill(~causal, float("-inf"))
            out[a:b, h] = scores.softmax(-1) @ vs
    return out


def _layout(lengths, hq, hkv, d=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _measured():
    rows = json.loads(H200_JSON.read_text())["results"]
    return {(r["layout"], r["method"]): r["time_ms"] for r in rows}


def _bench_lengths(layout):
    """The H200 run's layouts (scripts/bench_attention.py, 65,536 tokens, seed 0), rebuilt here."""
    if layout == "long":
        return [8192] * 8
    g, lengths, left = torch.Generator().manual_seed(0), [], 65536
    while left > 0:
        lengths.append(min(left, int(torch.randint(64, 1500, (1,), generator=g))))
        left -= lengths[-1]
    return lengths


@pytest.mark.parametrize("layout", ["short", "long"])
def test_the_model_reproduces_the_h200_measurements_it_cites(layout):
    lengths = _bench_lengths(layout)
    assert len(lengths) == {"short": 82, "long": 8}[layout]
    measured = _measured()
    grouped = ad.predicted_cuda_ms(lengths, 16, 4, 128, native_gqa=False)
    one_call = ad.predicted_cuda_ms(lengths, 16, 4, 128, native_gqa=True)
    assert grouped[ad.PER_SEGMENT] == pytest.approx(measured[(layout, "per-segment")], rel=1e-3)
    assert grouped[ad.VARLEN] == pytest.approx(measured[(layout, "packed")], rel=1e-3)
    assert one_call[ad.VARLEN] == pytest.approx(measured[(layout, "varlen-repeat-kv")], rel=1e-3)
    fastest = min(
        (ad.PER_SEGMENT, "per-segment"), (ad.VARLEN, "packed"), key=lambda m: measured[(layout, m[1])]
    )
    assert ad.cuda_attention_path(lengths, 16, 4, 128, native_gqa=False) == fastest[0]


@pytest.mark.parametrize(
    "lengths,heads,native,expected",
    [
        ([700] * 90, (16, 4, 128), False, ad.VARLEN),  # many short segments: the RL case
        ([8192] * 8, (16, 4, 128), True, ad.PER_SEGMENT),  # few long ones, even with native GQA
        ([2048] * 32, (16, 4, 128), False, ad.VARLEN),  # below the ~4.2K crossover
        ([6144] * 10, (16, 4, 128), False, ad.PER_SEGMENT),  # above it
        ([4700] * 13, (16, 4, 128), False, ad.PER_SEGMENT),  # between the two crossovers:
        ([4700] * 13, (16, 4, 128), True, ad.VARLEN),  # one GQA call is cheaper than head groups
        ([49152] + [1024] * 16, (16, 4, 128), False, ad.PER_SEGMENT),  # one long segment dominates
        ([32768] + [300] * 109, (16, 4, 128), False, ad.VARLEN),  # ...unless launches outweigh it
        ([65536], (16, 4, 128), False, ad.PER_SEGMENT),  # one sequence: a single SDPA call
        ([8192] * 8, (2, 2, 32), False, ad.VARLEN),  # little work per score: launches dominate
    ],
)
def test_dispatch_on_constructed_layouts(lengths, heads, native, expected):
    assert ad.cuda_attention_path(lengths, *heads, native_gqa=native) == expected


def test_the_crossover_for_equal_segments_sits_between_the_measured_layouts():
    def path(length):
        return ad.cuda_attention_path([length] * (65536 // length), 16, 4, 128, native_gqa=False)

    assert [path(s) for s in (512, 1024, 2048, 4096)] == [ad.VARLEN] * 4
    assert [path(s) for s in (4608, 8192, 16384, 32768)] == [ad.PER_SEGMENT] * 4
    assert ad.cuda_attention_path([5, 0, 7], 4, 2, 8, native_gqa=False) == ad.VARLEN  # empty ignored


class FakeVarlen:
    """``varlen_attn``'s signature computed by the naive loop; refuses GQA without ``enable_gqa``."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=None, **kw):
        assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k)
        if q.shape[1] != k.shape[1] and not kw.get("enable_gqa"):
            raise ValueError("Expect query and key/value to have the same number of heads")
        self.calls += 1
        return naive_per_segment(q, k, v, cu_seq_q.tolist(), scale).to(q.dtype)


@pytest.mark.parametrize("native_gqa", [False, True])
@pytest.mark.parametrize(
    "lengths,expected",
    [([9, 1, 30, 4, 17, 2, 11], ad.VARLEN), ([40, 56], ad.PER_SEGMENT)],
)
def test_both_cuda_paths_match_the_naive_loop(monkeypatch, lengths, expected, native_gqa):
    """bf16 through the CUDA dispatch (CPU tensors: the varlen kernel is a recording fake)."""
    fake = FakeVarlen()
    monkeypatch.setattr(pa, "_flash_attn_varlen", lambda: None)
    monkeypatch.setattr(pa, "_torch_varlen_attn", lambda: (fake, native_gqa))
    per_segment_calls = []
    real_reference = pa.packed_attention_reference
    monkeypatch.setattr(
        pa, "packed_attention_reference", lambda *a: per_segment_calls.append(1) or real_reference(*a)
    )
    if expected == ad.PER_SEGMENT:  # tiny layouts always favour varlen; with free launches, never
        monkeypatch.setattr(ad, "PER_SEGMENT_MS", 0.0)
    q, k, v, cu = _layout(lengths, 4, 2)
    assert pa.cuda_path_for(lengths, 4, 2, 8) == expected
    out = pa.packed_attention(q, k, v, cu, backend="cuda")
    assert (fake.calls > 0, bool(per_segment_calls)) == (expected == ad.VARLEN, expected == ad.PER_SEGMENT)
    ref = naive_per_segment(q, k, v, cu.tolist())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2**-7)  # bf16 output rounding
    other = pa.cuda_varlen_attention if expected == ad.PER_SEGMENT else real_reference
    torch.testing.assert_close(other(q, k, v, cu, 8**-0.5).double(), ref, rtol=0, atol=2**-7)
