"""Chunked token log-probs and entropy from hidden states, without materialising [T, V] logits.

For hidden states h [T, H], output head W [V, H], temperature τ and targets y [T]:

    z_t      = (h_t · Wᵀ) / τ                         logits, accumulated in float32 (or wider)
    lse_t    = log Σ_v exp(z_t,v)
    logp_t   = z_t,y_t − lse_t
    H_t      = lse_t − Σ_v p_t,v · z_t,v              entropy, p_t = softmax(z_t)

Gradients with respect to the logits of one token (both outputs are differentiable):

    ∂logp_t/∂z_t,v = 1[v = y_t] − p_t,v
    ∂H_t/∂z_t,v    = −p_t,v · (log p_t,v + H_t)

:class:`ChunkedLogProbs` walks T in chunks of C tokens; the backward recomputes each chunk's logits
from (h, W) instead of saving them, so peak extra memory is O(C·V) (plus the [V, H] weight-gradient
accumulator) instead of O(T·V): 64K × 248K float32 logits would be 63 GB.

Precision: with bf16/fp16 inputs the logits are *accumulated* in float32, never rounded to bf16
first (rounding them costs 4e-3 to 4e-2 nats of log-prob). On CUDA that is one half-precision GEMM
with a float32 output (``torch.mm(..., out_dtype=torch.float32)``, the speed of a bf16 GEMM);
elsewhere the operands are upcast to float32 (the CPU has no such GEMM; on the NPU the upcast is
correct but slower). Backward GEMMs take ∂/∂z in the weight's dtype, as autograd would for a bf16
``h @ Wᵀ``, and the weight gradient accumulates across chunks in float32.

On CUDA the per-chunk pointwise work (log-softmax, entropy, ∂/∂z) is fused by ``torch.compile``
(``fused=None`` means: on CUDA); that keeps the kernel close to a naive bf16 implementation in time.

A target id < 0 (e.g. -100 on prompt or padding positions) yields logp 0 and no gradient from
that token's logp (its entropy is still computed). :func:`naive_logprobs_entropy` is the
reference: full float32 logits, log_softmax, gather — the oracle in tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_SIZE = 2048


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


_HALF = (torch.bfloat16, torch.float16)
_OUT_DTYPE_GEMM: dict[tuple[str, torch.dtype], bool] = {}


def has_f32_out_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for half inputs on this device type
    (CUDA: yes; the CPU build has no such kernel). Probed once per (device type, dtype)."""
    key = (device.type, dtype)
    if key not in _OUT_DTYPE_GEMM:
        if device.type == "cpu" or dtype not in _HALF:
            _OUT_DTYPE_GEMM[key] = False
        else:
            try:
                probe = torch.ones(2, 2, dtype=dtype, device=device)
                _OUT_DTYPE_GEMM[key] = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError, NotImplementedError):
                _OUT_DTYPE_GEMM[key] = False
    return _OUT_DTYPE_GEMM[key]


def _gemm_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight as every chunk's GEMM takes it: as is where a float32-output GEMM exists, else
    upcast once per call (not once per chunk)."""
    if dtype == torch.float32 and has_f32_out_gemm(weight.device, weight.dtype):
        return weight
    return weight.to(dtype)


def _mm(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` accumulated and returned in ``dtype`` (>= float32), never rounded to a half type."""
    if dtype == torch.float32 and a.dtype == b.dtype and has_f32_out_gemm(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.to(dtype), b.to(dtype))


def naive_logprobs_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Reference: ``logits = hidden.float() @ weight.float().T / τ``; ``log_softmax``; gather; entropy.

    Materialises [T, V] logits in float32 (float64 for float64 inputs); use only for small sizes
    and as the test oracle.
    """
    dtype = _compute_dtype(hidden, weight)
    logits = (hidden.to(dtype) @ weight.to(dtype).t()) / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    valid = targets >= 0
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, torch.zeros((), dtype=dtype, device=picked.device))
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


# The two per-chunk functions take their logits buffer over (callers pass it without keeping a
# reference), so in eager mode at most two [C, V] buffers are alive at once; in-place ops touch
# only buffers made here, which torch.compile fuses exactly like their out-of-place forms.


def _chunk_forward(
    logits: Tensor, targets: Tensor, temperature: float, with_hits: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One chunk's (logp, entropy, lse, hits) from its logits [C, V] (targets < 0: logp 0).
    ``hits`` (only ``with_hits``): whether the target is the argmax (first index on ties), else None."""
    hits = (logits.argmax(-1) == targets) if with_hits else None
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits - lse.unsqueeze(-1)
    del logits
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(targets >= 0, picked, torch.zeros_like(picked))
    entropy = -logprobs.exp().mul_(logprobs).sum(-1)
    return logp, entropy, lse, hits


def _chunk_grad_logits(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    out_dtype: torch.dtype,
) -> Tensor:
    """∂(Σ g_lp·logp + g_H·H)/∂(h·Wᵀ) for one chunk, in ``out_dtype``:
    (g_lp·onehot(y) − p·(g_lp + g_H·(log p + H))) / τ, with g_lp already 0 where y < 0."""
    # z/τ − lse. Not ``torch.add(-lse, z, alpha=1/τ)``: compiled with dynamic shapes (torch 2.13,
    # CPU inductor), that form came out wrong for τ != 1 whenever the entropy had no gradient
    # (test_fused_logp_only_gradient_with_temperature).
    if temperature != 1.0:
        logprobs = logits.mul(1.0 / temperature)
        del logits
        logprobs.sub_(lse.unsqueeze(-1))
    else:
        logprobs = logits - lse.unsqueeze(-1)
        del logits
    g_lp = grad_logp.unsqueeze(-1)
    grad_z = logprobs.exp()
    factor = logprobs.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(g_lp)
    grad_z.mul_(factor).neg_()
    del factor, logprobs
    grad_z.scatter_add_(-1, targets.clamp(min=0).unsqueeze(-1), g_lp)
    if temperature != 1.0:
        grad_z.div_(temperature)
    return grad_z.to(out_dtype)


_COMPILED: dict[str, object] = {}


def _pointwise(name: str, fused: bool):
    """The per-chunk function, compiled once (dynamic shapes: the last chunk is shorter) when fused."""
    fn = {"forward": _chunk_forward, "grad": _chunk_grad_logits}[name]
    if not fused:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


class ChunkedLogProbs(torch.autograd.Function):
    """autograd Function: (hidden [T, H], weight [V, H], targets [T]) → (logp [T], entropy [T],
    hits [T] bool: target == argmax, non-differentiable; empty unless ``with_hits``)."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        fused: bool,
        with_hits: bool = False,
    ):
        dtype = _compute_dtype(hidden, weight)
        num_tokens = hidden.shape[0]
        logp = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        entropy = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        hits = torch.zeros(num_tokens if with_hits else 0, dtype=torch.bool, device=hidden.device)
        forward_chunk = _pointwise("forward", fused)
        weight_t = _gemm_weight(weight, dtype).t()
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logp[start:end], entropy[start:end], lse[start:end], chunk_hits = forward_chunk(
                _mm(hidden[start:end], weight_t, dtype), targets[start:end], temperature, with_hits
            )
            if with_hits:
                hits[start:end] = chunk_hits
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.mark_non_differentiable(hits)
        # An unused output then arrives as None in backward, and its term is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.fused = fused
        return logp, entropy, hits

    @staticmethod
    def backward(
        ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None, _grad_hits: Tensor | None = None
    ):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 7
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w):
            return none
        dtype = lse.dtype
        num_tokens = hidden.shape[0]
        zeros = torch.zeros(num_tokens, dtype=dtype, device=hidden.device)
        g_lp = zeros if grad_logp is None else torch.where(targets >= 0, grad_logp.to(dtype), zeros)
        g_ent = zeros if grad_entropy is None else grad_entropy.to(dtype)
        # The backward GEMMs take ∂/∂z in the weight's dtype where a float32-output GEMM exists (the
        # precision autograd gives a bf16 h @ Wᵀ); else everything stays in the compute dtype.
        fast = dtype == torch.float32 and has_f32_out_gemm(weight.device, weight.dtype)
        grad_dtype = weight.dtype if fast and hidden.dtype == weight.dtype else dtype
        grad_chunk = _pointwise("grad", ctx.fused)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # Accumulate the weight gradient in the compute dtype (>= float32) across chunks.
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        gemm_weight = _gemm_weight(weight, dtype)
        weight_t = gemm_weight.t()
        for start in range(0, num_tokens, ctx.chunk_size):
            end = min(start + ctx.chunk_size, num_tokens)
            h = hidden[start:end]
            grad_z = grad_chunk(
                _mm(h, weight_t, dtype),
                targets[start:end],
                lse[start:end],
                entropy[start:end],
                g_lp[start:end],
                g_ent[start:end],
                ctx.temperature,
                grad_dtype,
            )
            if need_h:
                grad_hidden[start:end] = _mm(grad_z, gemm_weight, dtype).to(hidden.dtype)
            if need_w:
                grad_weight += _mm(grad_z.t(), h, dtype)
            del grad_z
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Target-token log-probs and entropies, chunked over tokens; both outputs differentiable.

    hidden [..., H], weight [V, H], targets [...] (int; < 0 means "no target").
    Returns ``(logp [...], entropy [...])`` in float32 (float64 when the inputs are float64).
    ``fused``: compile the per-chunk pointwise work with ``torch.compile``; ``None``: on CUDA only.
    """
    logp, entropy, _ = _apply(hidden, weight, targets, temperature, chunk_size, fused, False)
    return logp, entropy


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != weight in-features {weight.shape[-1]}")


def _apply(hidden, weight, targets, temperature, chunk_size, fused, with_hits):
    _check(hidden, weight, targets, temperature, chunk_size)
    lead = targets.shape
    if fused is None:
        fused = hidden.device.type == "cuda"
    logp, entropy, hits = ChunkedLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        float(temperature),
        int(chunk_size),
        bool(fused),
        bool(with_hits),
    )
    return logp.reshape(lead), entropy.reshape(lead), (hits.reshape(lead) if with_hits else None)


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    fused: bool | None = None,
) -> Tensor:
    """Log-probs only (see :func:`chunked_logprobs_entropy`)."""
    return chunked_logprobs_entropy(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk_size, fused=fused
    )[0]


def chunked_logprobs_hits(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """``(logp, hits)``: log-probs (differentiable, as :func:`chunked_logprobs`) and whether each
    target is the argmax of its logits (``bool``, first index on ties; False where target < 0),
    in the same chunked pass: what a cross-entropy loss with an accuracy metric needs."""
    logp, _, hits = _apply(hidden, weight, targets, temperature, chunk_size, fused, True)
    return logp, hits
