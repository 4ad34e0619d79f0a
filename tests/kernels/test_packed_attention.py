"""Packed attention: CPU path vs a dense block-diagonal oracle; NPU call vs transformers' own."""

from __future__ import annotations

import math

import pytest
import torch
from areal_npu.kernels import packed_attention as pa
from areal_npu.kernels.packed_attention import npu_causal_mask, packed_attention
from hypothesis import given, settings
from hypothesis import strategies as st

import areal_npu.platform


def dense_reference(q, k, v, cu, scale=None):
    """O(T^2) dense attention with a block-diagonal causal mask, GQA by repeating kv heads."""
    t, hq, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    seg = torch.zeros(t, dtype=torch.long)
    for j, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        seg[a:b] = j
    idx = torch.arange(t)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    scores = torch.einsum("thd,uhd->htu", q.double(), k.double()) * (scale or 1 / math.sqrt(d))
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htu,uhd->thd", scores.softmax(-1), v.double()).to(q.dtype)


def make(lengths, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=24), min_size=1, max_size=6),
    st.sampled_from([(4, 4), (4, 2), (6, 1)]),
)
def test_cpu_path_matches_dense_block_diagonal(lengths, heads):
    q, k, v, cu = make(lengths, *heads)
    out = packed_attention(q, k, v, cu)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu.tolist()), rtol=1e-5, atol=1e-5)


def test_cpu_path_never_builds_a_total_by_total_score_matrix(monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.shape[-2] * k.shape[-2])
        return real(q, k, v, **kw)

    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", spy)
    lengths = [30, 5, 17, 2]
    packed_attention(*make(lengths))
    assert max(seen) == 30 * 30 and sum(seen) == sum(s * s for s in lengths)  # sum s_i^2, not T^2


class FakeTorchNpu:
    """Records npu_fusion_attention calls and answers with the dense oracle on the TND arguments."""

    def __init__(self):
        self.calls = []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, **kw):
        self.calls.append(
            dict(query=query, key=key, value=value, head_num=head_num, input_layout=input_layout, **kw)
        )
        assert input_layout == "TND" and kw["sparse_mode"] in (2, 3)
        cu = [0] + list(kw["actual_seq_qlen"])
        return (dense_reference(query, key, value, cu, kw["scale"]), None, None)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setattr(areal_npu.platform, "import_torch_npu", lambda: fake)
    return fake


def test_npu_call_arguments_match_transformers_integration(fake_npu, monkeypatch):
    from transformers.integrations import npu_flash_attention as hf_npu

    lengths = [5, 3, 9, 2]
    q, k, v, cu = make(lengths, hq=4, hkv=2, d=16)
    out = packed_attention(q, k, v, cu, backend="npu")
    ours = fake_npu.calls[-1]

    monkeypatch.setattr(hf_npu, "npu_fusion_attention", fake_npu.npu_fusion_attention, raising=False)
    monkeypatch.setattr(hf_npu, "SPARSE_MODE", hf_npu.DOWN_RIGHT_ALIGNED_CAUSAL_MASK_MODE)
    theirs_out = hf_npu.npu_flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    theirs = fake_npu.calls[-1]

    assert isinstance(ours["actual_seq_qlen"], list) and isinstance(ours["actual_seq_kvlen"], list)
    assert all(type(x) is int for x in ours["actual_seq_qlen"])
    assert ours["actual_seq_qlen"] == list(theirs["actual_seq_qlen"]) == [5, 8, 17, 19]
    assert ours["actual_seq_kvlen"] == list(theirs["actual_seq_kvlen"]) == [5, 8, 17, 19]
    for key in ("head_num", "input_layout", "sparse_mode", "scale", "keep_prob", "pse", "padding_mask"):
        assert ours[key] == theirs[key], key
    assert ours["head_num"] == 4 and ours["sparse_mode"] == 3 and ours["scale"] == 1 / math.sqrt(16)
    assert ours["atten_mask"].dtype == torch.bool and torch.equal(ours["atten_mask"], theirs["atten_mask"])
    assert torch.equal(ours["atten_mask"], torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))
    for key in ("query", "key", "value"):
        assert torch.equal(ours[key], theirs[key])  # GQA: kv heads passed as they are
    torch.testing.assert_close(out, theirs_out)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu.tolist()), rtol=1e-5, atol=1e-5)


def test_npu_mask_is_cached_once(fake_npu):
    q, k, v, cu = make([3, 4])
    packed_attention(q, k, v, cu, backend="npu")
    packed_attention(q, k, v, cu, backend="npu")
    assert fake_npu.calls[0]["atten_mask"] is fake_npu.calls[1]["atten_mask"] is npu_causal_mask("cpu")


def test_npu_splits_calls_above_1024_segments(fake_npu):
    lengths = [1 + (i % 3) for i in range(2500)]
    q, k, v, cu = make(lengths, hq=2, hkv=1, d=4)
    out = packed_attention(q, k, v, cu, backend="npu")
    assert [len(c["actual_seq_qlen"]) for c in fake_npu.calls] == [1024, 1024, 452]
    ends = cu[1:].tolist()
    assert fake_npu.calls[0]["actual_seq_qlen"] == ends[:1024]
    second = [e - ends[1023] for e in ends[1024:2048]]
    assert fake_npu.calls[1]["actual_seq_qlen"] == second  # offsets restart for each call
    assert sum(c["query"].shape[0] for c in fake_npu.calls) == q.shape[0]
    torch.testing.assert_close(out, packed_attention(q, k, v, cu, backend="cpu"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "hq,hkv,d,match",
    [(4, 2, 800, "head_dim <= 768"), (257, 257, 8, "1..256 query heads"), (6, 4, 8, "multiple of kv heads")],
)
def test_npu_limits_are_rejected_clearly(fake_npu, hq, hkv, d, match):
    q, k, v, cu = (
        torch.zeros(4, hq, d),
        torch.zeros(4, hkv, d),
        torch.zeros(4, hkv, d),
        torch.tensor([0, 4]),
    )
    with pytest.raises(ValueError, match=match):
        packed_attention(q, k, v, cu, backend="npu")
    assert not fake_npu.calls


def test_bad_cu_seqlens_and_backend():
    q, k, v, cu = make([3, 4])
    with pytest.raises(ValueError, match="end at T=7"):
        packed_attention(q, k, v, torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="unknown packed attention backend"):
        packed_attention(q, k, v, cu, backend="tpu")


class FakeVarlen:
    """``varlen_attn`` with PyTorch's signature, computed by the dense oracle; records each call.

    Without ``native_gqa`` it refuses unequal head counts, as torch 2.11's ``varlen_attn`` does."""

    def __init__(self, native_gqa):
        self.native_gqa = native_gqa
        self.calls = []

    def __call__(self, q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
        self.calls.append({"k": k, "v": v, "heads": q.shape[1], "window": window_size, **kw})
        assert window_size == (-1, 0), "causal attention is window_size=(-1, 0)"
        assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
        if q.shape[1] != k.shape[1] and not kw.get("enable_gqa"):
            raise ValueError("Expect query and key/value to have the same number of heads")
        return dense_reference(q, k, v, cu_seq_q.tolist(), scale)


@pytest.mark.parametrize("native_gqa", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_varlen_path_gqa_without_repeating_kv(heads, native_gqa):
    q, k, v, cu = make([6, 1, 9, 4], *heads)
    fake = FakeVarlen(native_gqa)
    out = pa.varlen_causal_attention(fake, q, k, v, cu, 9, 1 / math.sqrt(q.shape[-1]), native_gqa)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu.tolist()), rtol=1e-5, atol=1e-5)
    rep = heads[0] // heads[1]
    assert len(fake.calls) == (1 if native_gqa or rep == 1 else rep)
    for call in fake.calls:  # the very K/V tensors: never a repeated copy
        assert call["k"] is k and call["v"] is v


def test_cuda_dispatch_half_precision_uses_varlen_full_precision_is_exact(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flash(name, *a, **kw):
        if name.startswith("flash_attn"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_flash)
    fake = FakeVarlen(native_gqa=False)
    monkeypatch.setattr(pa, "_torch_varlen_attn", lambda: (fake, False))
    q, k, v, cu = make([6, 2, 9])
    # float32: the exact per-segment path (the varlen kernels are half precision only).
    out = packed_attention(q, k, v, cu, backend="cuda")  # CPU tensors: exercises the dispatch only
    torch.testing.assert_close(out, dense_reference(q, k, v, cu.tolist()), rtol=1e-5, atol=1e-5)
    assert fake.calls == []
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    out = packed_attention(qb, kb, vb, cu, backend="cuda")
    assert len(fake.calls) == 2  # 4 query heads over 2 KV heads: two MHA calls
    torch.testing.assert_close(out, dense_reference(qb, kb, vb, cu.tolist()), rtol=0, atol=0)


def test_torch_varlen_attn_signature_is_what_the_cuda_path_calls():
    varlen_attn, native_gqa = pa._torch_varlen_attn()
    if varlen_attn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    import inspect

    params = inspect.signature(varlen_attn).parameters
    assert list(params)[:7] == ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
    assert params["window_size"].kind is inspect.Parameter.KEYWORD_ONLY
    assert native_gqa == ("enable_gqa" in params)
