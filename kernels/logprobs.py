"""Chunked token log-probs and entropy from hidden states, without materialising [T, V] logits.

For hidden states h [T, H], output head W [V, H], temperature τ and targets y [T]:

    z_t      = (h_t · Wᵀ) / τ                         logits, computed in float32 (or wider)
    lse_t    = log Σ_v exp(z_t,v)
    logp_t   = z_t,y_t − lse_t
    H_t      = lse_t − Σ_v p_t,v · z_t,v              entropy, p_t = softmax(z_t)

Gradients with respect to the logits of one token (both outputs are differentiable):

    ∂logp_t/∂z_t,v = 1[v = y_t] − p_t,v
    ∂H_t/∂z_t,v    = −p_t,v · (log p_t,v + H_t)

:class:`ChunkedLogProbs` walks T in chunks of C tokens; the backward recomputes each chunk's logits
from (h, W) instead of saving them, so peak extra memory is O(C·V) (plus the [V, H] weight-gradient
accumulator) instead of O(T·V): 64K × 248K float32 logits would be 63 GB.

A target id < 0 (e.g. -100 on prompt or padding positions) yields logp 0 and no gradient from
that token's logp (its entropy is still computed). :func:`naive_logprobs_entropy` is the
reference: full logits, log_softmax, gather — the CPU oracle in tests.
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


def naive_logprobs_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Reference: ``logits = (hidden @ weight.T).float() / τ``; ``log_softmax``; gather; entropy.

    Materialises [T, V] logits; use only for small sizes and as the test oracle.
    """
    dtype = _compute_dtype(hidden, weight)
    logits = (hidden @ weight.t()).to(dtype) / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    valid = targets >= 0
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked, torch.zeros((), dtype=dtype, device=picked.device))
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


class ChunkedLogProbs(torch.autograd.Function):
    """autograd Function: (hidden [T, H], weight [V, H], targets [T]) → (logp [T], entropy [T])."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int):
        dtype = _compute_dtype(hidden, weight)
        num_tokens = hidden.shape[0]
        logp = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        entropy = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        valid = targets >= 0
        safe_targets = targets.clamp(min=0)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = (hidden[start:end] @ weight.t()).to(dtype)
            if temperature != 1.0:
                logits.div_(temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, safe_targets[start:end].unsqueeze(-1)).squeeze(-1)
            logp[start:end] = torch.where(valid[start:end], picked - chunk_lse, torch.zeros_like(picked))
            # H = −Σ p·log p with log p written over the logits: two [C, V] buffers at most.
            logprobs = logits.sub_(chunk_lse.unsqueeze(-1))
            entropy[start:end] = -logprobs.exp().mul_(logprobs).sum(-1)
            lse[start:end] = chunk_lse
            del logits, logprobs
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        # An unused output then arrives as None in backward, and its term is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None
        dtype = lse.dtype
        tau = ctx.temperature
        num_tokens = hidden.shape[0]
        valid = targets >= 0
        safe_targets = targets.clamp(min=0)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # Accumulate the weight gradient in the compute dtype (>= float32) across chunks.
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        for start in range(0, num_tokens, ctx.chunk_size):
            end = min(start + ctx.chunk_size, num_tokens)
            h = hidden[start:end]
            logits = (h @ weight.t()).to(dtype)
            if tau != 1.0:
                logits.div_(tau)
            # Write log p over the logits and build ∂/∂z in the probs buffer: two [C, V] buffers.
            #   ∂(g_lp·logp + g_H·H)/∂z = g_lp·onehot(y) − p·(g_lp + g_H·(log p + H))
            logprobs = logits.sub_(lse[start:end].unsqueeze(-1))
            grad_z = logprobs.exp()
            zero = torch.zeros((), dtype=dtype, device=grad_z.device)
            if grad_logp is not None:
                g_lp = torch.where(valid[start:end], grad_logp[start:end].to(dtype), zero).unsqueeze(-1)
            else:
                g_lp = torch.zeros((end - start, 1), dtype=dtype, device=grad_z.device)
            if grad_entropy is not None:
                g_ent = grad_entropy[start:end].to(dtype).unsqueeze(-1)
                factor = logprobs.add_(entropy[start:end].unsqueeze(-1)).mul_(g_ent).add_(g_lp)
                grad_z.mul_(factor).neg_()
            else:
                grad_z.mul_(g_lp).neg_()
            del logits, logprobs
            grad_z.scatter_add_(-1, safe_targets[start:end].unsqueeze(-1), g_lp)
            if tau != 1.0:
                grad_z.div_(tau)
            if need_h:
                grad_hidden[start:end] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_weight.addmm_(grad_z.t(), h.to(dtype))
            del grad_z
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Target-token log-probs and entropies, chunked over tokens; both outputs differentiable.

    hidden [..., H], weight [V, H], targets [...] (int; < 0 means "no target").
    Returns ``(logp [...], entropy [...])`` in float32 (float64 when the inputs are float64).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != weight in-features {weight.shape[-1]}")
    lead = targets.shape
    logp, entropy = ChunkedLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), float(temperature), int(chunk_size)
    )
    return logp.reshape(lead), entropy.reshape(lead)


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probs only (see :func:`chunked_logprobs_entropy`)."""
    return chunked_logprobs_entropy(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)[
        0
    ]
