"""The CUDA paths of the kernels against float64 references (run only where a GPU is present).

Tolerances: bf16 has an 8-bit mantissa, so any bf16 computation is off from float64 by roughly
2**-8 relative per operation. Rather than a magic number, each check measures the error of an
independent bf16 computation (PyTorch SDPA per segment / a bf16 GEMM rounded to bf16) and requires
ours to be no worse than a small multiple of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from areal_npu.kernels import packed_attention as pa
from areal_npu.kernels.logprobs import chunked_logprobs_entropy, has_f32_out_gemm, naive_logprobs_entropy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


BF16_EPS = 2.0**-7  # twice bf16's unit roundoff (8-bit mantissa)


def _rel_err(a, ref):
    return ((a - ref).norm() / ref.norm()).item()


def _packed(lengths, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g, device="cuda", dtype=dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _per_segment_sdpa(q, k, v, cu):
    """Independent reference: PyTorch SDPA on each segment alone (any dtype, GQA by repetition)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs = q[a:b].transpose(0, 1)
        ks, vs = (x[a:b].repeat_interleave(rep, dim=1).transpose(0, 1) for x in (k, v))
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        )
    return torch.cat(outs)


@pytest.mark.parametrize(
    "lengths", [[1, 700, 33, 2048, 5, 1200], [8192, 8192]], ids=["short-varlen", "long-per-segment"]
)
@pytest.mark.parametrize("heads", [(16, 4), (8, 8)])
def test_packed_attention_bf16_forward_backward_vs_float64(heads, lengths):
    """Both paths of the dispatch by layout (short: varlen; two 8K segments: SDPA per segment)."""
    expected = "varlen" if len(lengths) > 2 else "per_segment"
    assert pa.cuda_path_for(lengths, heads[0], heads[1], 128) == expected
    q, k, v, cu = _packed(lengths, *heads, 128, torch.bfloat16)
    grad_out = torch.randn_like(q)
    results = {}
    for name, fn, dtype in [
        ("ours", lambda *x: pa.packed_attention(*x, backend="cuda"), torch.bfloat16),
        ("bf16_sdpa", _per_segment_sdpa, torch.bfloat16),
        ("fp64", _per_segment_sdpa, torch.float64),
    ]:
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*xs, cu)
        out.backward(grad_out.to(dtype))
        results[name] = [out.detach().double()] + [x.grad.double() for x in xs]
    for i, what in enumerate(["out", "dq", "dk", "dv"]):
        ref = results["fp64"][i]
        err_ours = _rel_err(results["ours"][i], ref)
        err_sdpa = _rel_err(results["bf16_sdpa"][i], ref)
        assert err_ours <= max(2 * err_sdpa, BF16_EPS), (what, err_ours, err_sdpa)


def test_varlen_path_is_taken_for_bf16(monkeypatch):
    calls = []
    real = pa.varlen_causal_attention
    monkeypatch.setattr(pa, "varlen_causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, cu = _packed([5, 9], 4, 2, 64, torch.bfloat16)
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn installed: the flash path is taken instead")
    except ImportError:
        pass
    pa.packed_attention(q, k, v, cu)
    assert calls == [1]


def test_chunked_logprobs_bf16_accumulate_in_float32():
    assert has_f32_out_gemm(torch.device("cuda"), torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 1024, 512, 32000
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 4 / math.sqrt(H)).bfloat16()
    targets = torch.randint(0, V, (T,), device="cuda", generator=g)
    targets[::7] = -100
    ref_lp, ref_ent = naive_logprobs_entropy(hidden.double(), weight.double(), targets)
    for fused in (False, True):
        lp, ent = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=300, fused=fused)
        assert (lp.double() - ref_lp).abs().max() < 1e-3
        assert (ent.double() - ref_ent).abs().max() < 1e-3
    # What the fix avoids: logits rounded to bf16 before the softmax are off by far more.
    rounded = torch.log_softmax((hidden @ weight.t()).double(), -1).gather(-1, targets.clamp(min=0)[:, None])[
        :, 0
    ]
    assert (rounded - ref_lp)[targets >= 0].abs().max() > 4e-3


def test_chunked_logprobs_bf16_grads_vs_float64():
    g = torch.Generator(device="cuda").manual_seed(1)
    T, H, V = 777, 256, 5000
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 2 / math.sqrt(H)).bfloat16()
    targets = torch.randint(0, V, (T,), device="cuda", generator=g)
    c_lp, c_ent = torch.randn(T, device="cuda", generator=g), torch.randn(T, device="cuda", generator=g)

    def grads(fn, dtype, **kw):
        h, w = (x.detach().to(dtype).clone().requires_grad_() for x in (hidden, weight))
        lp, ent = fn(h, w, targets, **kw)
        (lp * c_lp + ent * c_ent).sum().backward()
        return h.grad.double(), w.grad.double()

    ref = grads(naive_logprobs_entropy, torch.float64)
    bf16_autograd = grads(naive_logprobs_entropy, torch.bfloat16)  # float32 logits, bf16 GEMM grads
    for fused in (False, True):
        ours = grads(chunked_logprobs_entropy, torch.bfloat16, chunk_size=256, fused=fused)
        for a, b, r in zip(ours, bf16_autograd, ref):
            assert (a - r).abs().max() <= 2 * (b - r).abs().max() + 1e-6
