import math

import pytest
import torch
from areal_npu.kernels.logprobs import (
    chunked_logprobs,
    chunked_logprobs_entropy,
    chunked_logprobs_hits,
    naive_logprobs_entropy,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def make(T, H, V, dtype=torch.float32, seed=0, ignore_every=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / math.sqrt(H) * 3
    targets = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    return hidden, weight, targets


def test_naive_reference_matches_per_token_loop():
    hidden, weight, targets = make(5, 4, 7, dtype=torch.float64, ignore_every=3)
    logp, ent = naive_logprobs_entropy(hidden, weight, targets, temperature=0.6)
    for t in range(5):
        z = [float(hidden[t] @ weight[v]) / 0.6 for v in range(7)]
        lse = math.log(sum(math.exp(x) for x in z))
        p = [math.exp(x - lse) for x in z]
        expect_lp = 0.0 if int(targets[t]) < 0 else z[int(targets[t])] - lse
        assert float(logp[t]) == pytest.approx(expect_lp, abs=1e-12)
        assert float(ent[t]) == pytest.approx(-sum(pi * math.log(pi) for pi in p), abs=1e-12)


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_gradcheck_float64(which):
    hidden, weight, targets = make(11, 5, 13, dtype=torch.float64, ignore_every=4)
    hidden.requires_grad_()
    weight.requires_grad_()

    def f(h, w):
        lp, ent = chunked_logprobs_entropy(h, w, targets, temperature=0.7, chunk_size=4)
        return {"logp": lp, "entropy": ent, "both": (lp, ent)}[which]

    assert torch.autograd.gradcheck(f, (hidden, weight))


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 40),
    V=st.integers(2, 60),
    chunk=st.integers(1, 17),
    temperature=st.sampled_from([1.0, 0.5, 1.3]),
    seed=st.integers(0, 1000),
)
def test_chunked_matches_naive_fp32_with_grads(T, V, chunk, temperature, seed):
    H = 8
    hidden, weight, targets = make(T, H, V, seed=seed, ignore_every=5)
    g = torch.Generator().manual_seed(seed + 1)
    c_lp, c_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)

    def run(fn, **kw):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        lp, ent = fn(h, w, targets, temperature=temperature, **kw)
        (lp * c_lp + ent * c_ent).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    ours = run(chunked_logprobs_entropy, chunk_size=chunk)
    ref = run(naive_logprobs_entropy)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours[0][targets < 0], torch.zeros_like(ours[0][targets < 0]))


def test_logp_only_gradient_and_leading_dims():
    hidden, weight, targets = make(24, 6, 30, seed=3)
    h1 = hidden.view(4, 6, 6).clone().requires_grad_()
    w1 = weight.clone().requires_grad_()
    lp = chunked_logprobs(h1, w1, targets.view(4, 6), chunk_size=7)
    assert lp.shape == (4, 6)
    lp.sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    naive_logprobs_entropy(h2, w2, targets)[0].sum().backward()
    torch.testing.assert_close(h1.grad.view(24, 6), h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_bfloat16_inputs_close_to_naive():
    hidden, weight, targets = make(32, 16, 50, dtype=torch.bfloat16, seed=4)
    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=8)
    ref_lp, ref_ent = naive_logprobs_entropy(hidden, weight, targets)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-3, atol=1e-3)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    chunked_logprobs(h, w, targets, chunk_size=8).sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    naive_logprobs_entropy(h2, w2, targets)[0].sum().backward()
    torch.testing.assert_close(h.grad.float(), h2.grad.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.float(), w2.grad.float(), rtol=2e-2, atol=2e-2)


def test_nothing_of_size_T_times_V_is_saved_for_backward():
    T, H, V = 64, 8, 100
    hidden, weight, targets = make(T, H, V)
    hidden.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp, ent = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=16)
    assert max(saved) == max(T * H, V * H)  # only the inputs, no [T, V] or [chunk, V] buffers
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        naive_logprobs_entropy(hidden, weight, targets)
    assert max(saved) >= T * V  # the reference does keep full logits


def test_argument_checks():
    hidden, weight, targets = make(4, 3, 5)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_logprobs(hidden, weight, targets[:3])


def test_bfloat16_logits_are_not_rounded_before_the_softmax():
    """bf16 inputs: log-probs equal the float64 computation on the same bf16 values to float32
    accuracy. Rounding the logits to bf16 first (a bf16 GEMM, then .float()) is off by ~1e-2 here."""
    hidden, weight, targets = make(64, 32, 300, seed=7)
    hidden, weight = hidden.bfloat16(), (weight * 2).bfloat16()
    exact_lp, exact_ent = naive_logprobs_entropy(hidden.double(), weight.double(), targets)
    rounded = torch.log_softmax((hidden @ weight.t()).double(), -1).gather(-1, targets[:, None])[:, 0]
    assert (rounded - exact_lp).abs().max() > 1e-3  # the error this test is about is visible here
    for lp, ent in (
        chunked_logprobs_entropy(hidden, weight, targets, chunk_size=16),
        naive_logprobs_entropy(hidden, weight, targets),  # the oracle itself computes in float32
    ):
        torch.testing.assert_close(lp.double(), exact_lp, rtol=0, atol=1e-4)
        torch.testing.assert_close(ent.double(), exact_ent, rtol=0, atol=1e-4)


def test_fused_pointwise_matches_eager_on_this_device():
    """``fused=True`` (torch.compile of the per-chunk work) computes the same values and gradients."""
    hidden, weight, targets = make(37, 8, 50, seed=9, ignore_every=4)
    c = torch.linspace(-1, 1, 37)

    def run(fused):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = chunked_logprobs_entropy(h, w, targets, temperature=0.7, chunk_size=10, fused=fused)
        (lp * c + ent * c.flip(0)).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature, fused", [(1.0, False), (0.6, False), (0.6, True)])
def test_hits_are_the_argmax_of_full_logits_and_logp_is_unchanged(temperature, fused):
    """``fused=True`` is CUDA's default path (the per-chunk work compiled), run here on this device."""
    hidden, weight, targets = make(41, 8, 30, seed=11, ignore_every=6)
    full = hidden @ weight.t()
    targets[1::4] = full[1::4].argmax(-1)  # some targets are the argmax
    targets[0] = -100
    h = hidden.clone().requires_grad_()
    logp, hits = chunked_logprobs_hits(h, weight, targets, temperature=temperature, chunk_size=9, fused=fused)
    expected = (full.argmax(-1) == targets) & (targets >= 0)
    assert hits.dtype == torch.bool and not hits.requires_grad
    assert torch.equal(hits, expected) and int(hits.sum()) >= 8
    ref_lp, _ = naive_logprobs_entropy(hidden, weight, targets, temperature)
    torch.testing.assert_close(logp, ref_lp, rtol=1e-5, atol=1e-6)
    logp.sum().backward()
    h2 = hidden.clone().requires_grad_()
    naive_logprobs_entropy(h2, weight, targets, temperature)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-5)  # the fp32 bound used above


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_fused_logp_only_gradient_with_temperature(temperature):
    """Only logp carries gradient (the entropy is a detached statistic, as in the PPO loss) and
    tau != 1, over several chunks: the compiled per-chunk work gives the naive gradient. (It did not
    when the logits were scaled with ``torch.add(..., alpha=1/tau)``: errors of 5 to 7000.)"""
    hidden, weight, targets = make(41, 8, 30, seed=11, ignore_every=6)
    h = hidden.clone().requires_grad_()
    lp, _ = chunked_logprobs_entropy(h, weight, targets, temperature=temperature, chunk_size=9, fused=True)
    lp.sum().backward()
    h2 = hidden.clone().requires_grad_()
    naive_logprobs_entropy(h2, weight, targets, temperature)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-5)
