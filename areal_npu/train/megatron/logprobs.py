"""Token log-probs and entropy on a tensor-parallel (vocabulary-sharded) output head, chunked.

TP rank ``r`` holds rows ``[r V/tp, (r+1) V/tp)`` of the head ``W``. For hidden states ``h`` [T, H]
(replicated over the TP group), temperature ``τ`` and global target ids ``y``, per chunk of tokens:

    z^r_t   = h_t W_r^T / τ                          local logits [C, V/tp], float32
    m_t     = max_r max_v z^r_t,v                    all-reduce MAX
    S_t     = Σ_r Σ_v exp(z^r_t,v − m_t)             all-reduce SUM  (together with the next two)
    Z_t     = Σ_r Σ_v exp(z^r_t,v − m_t) z^r_t,v
    z_t,y   = the target's logit, from the one rank that holds it
    lse_t   = m_t + log S_t,   logp_t = z_t,y − lse_t,   H_t = lse_t − Z_t / S_t

so two collectives per chunk and never a ``[T, V]`` tensor.

The GEMM ``h W_r^T`` (:func:`head_logits`): with bf16 (or fp16) ``h`` and ``W`` it is a half
GEMM, accumulated in float32 by the device's kernel, never an fp32 GEMM on an upcast copy of the
head (at 248K x 5120 that copy alone is 5 GB). Where the device has a half GEMM with a float32
output (``torch.mm(..., out_dtype=torch.float32)``: CUDA; probed once, so also a torch_npu that
maps it) the logits stay float32; elsewhere (the CPU, the NPU otherwise) the kernel's output is
rounded to the half type and upcast, as Megatron's own output layer feeding
``vocab_parallel_cross_entropy`` does: up to ``2^-8 |z|`` a logit, so a log-prob within
``2^-7 max |z|``. The softmax, log-probs and entropy are float32 either way.

Backward recomputes each chunk's local logits (as :mod:`areal_npu.kernels.logprobs` does) and
applies, on the local columns,

    ∂/∂z_v = (g_lp 1[v = y] − p_v (g_lp + g_H (log p_v + H))) / τ

returning this rank's *partial* ∂h; the caller passes ``h`` through Megatron's
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), which sums the
partials over the TP group. With ``group=None`` (or one rank) this is the plain chunked kernel;
:func:`areal_npu.kernels.logprobs.naive_logprobs_entropy` on the full head is the test oracle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from areal_npu.kernels.logprobs import has_f32_out_gemm

__all__ = ["head_logits", "vocab_parallel_logprobs_entropy"]

_HALF = (torch.bfloat16, torch.float16)


def head_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """``hidden @ weight.T`` in float32 or wider (the module docstring): a half GEMM with float32
    accumulation for half inputs (no float32 copy of ``weight``), the GEMM in the wider type else."""
    if hidden.dtype == weight.dtype and weight.dtype in _HALF:
        return _half_mm(hidden, weight.t())
    dtype = torch.promote_types(torch.float32, torch.promote_types(hidden.dtype, weight.dtype))
    return hidden.to(dtype) @ weight.to(dtype).t()


def _half_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of two half tensors as a half GEMM accumulated in float32, returned in float32."""
    if has_f32_out_gemm(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).float()  # fp32 accumulation in the kernel, the output rounded once


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_stats(z: Tensor, targets: Tensor, vocab_start: int, group):
    """(lse, logp, entropy) of one chunk of local logits (float32)."""
    local_max = z.max(dim=-1).values
    m = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
    e = torch.exp(z - m[:, None])
    vocab = z.shape[-1]
    local_ids = targets - vocab_start
    mine = (local_ids >= 0) & (local_ids < vocab)
    picked = z.gather(-1, local_ids.clamp(0, vocab - 1)[:, None])[:, 0] * mine
    sums = _all_reduce(torch.stack([e.sum(-1), (e * z).sum(-1), picked]), dist.ReduceOp.SUM, group)
    lse = m + torch.log(sums[0])
    logp = torch.where(targets >= 0, sums[2] - lse, torch.zeros_like(lse))
    entropy = lse - sums[1] / sums[0]
    return lse, logp, entropy


class VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, temperature, chunk_size, group):
        n = hidden.shape[0]
        dtype = torch.promote_types(torch.float32, torch.promote_types(hidden.dtype, weight.dtype))
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        logp = torch.empty_like(lse)
        entropy = torch.empty_like(lse)
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            z = head_logits(hidden[a:b], weight) / temperature
            lse[a:b], logp[a:b], entropy[a:b] = _chunk_stats(z, targets[a:b], vocab_start, group)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.set_materialize_grads(False)
        ctx.args = (vocab_start, temperature, chunk_size)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        vocab_start, temperature, chunk_size = ctx.args
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        dtype = lse.dtype
        zeros = torch.zeros_like(lse)
        g_lp = zeros if grad_logp is None else torch.where(targets >= 0, grad_logp.to(dtype), zeros)
        g_h = zeros if grad_entropy is None else grad_entropy.to(dtype)
        half = hidden.dtype == weight.dtype and weight.dtype in _HALF
        vocab = weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # the weight gradient accumulates over chunks in float32 (or wider)
        grad_weight = (
            torch.zeros(weight.shape, dtype=dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for a in range(0, hidden.shape[0], chunk_size):
            b = min(a + chunk_size, hidden.shape[0])
            h = hidden[a:b]
            log_p = head_logits(h, weight) / temperature - lse[a:b, None]
            grad_z = -torch.exp(log_p) * (g_lp[a:b, None] + g_h[a:b, None] * (log_p + entropy[a:b, None]))
            local_ids = targets[a:b] - vocab_start
            mine = (local_ids >= 0) & (local_ids < vocab)
            grad_z.scatter_add_(-1, local_ids.clamp(0, vocab - 1)[:, None], (g_lp[a:b] * mine)[:, None])
            grad_z /= temperature
            if half:  # ∂/∂z in the head's dtype, as autograd gives a half h @ W^T; GEMMs accumulate in fp32
                grad_z = grad_z.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[a:b] = _half_mm(grad_z, weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += _half_mm(grad_z.t().contiguous(), h)
                continue
            if grad_hidden is not None:
                grad_hidden[a:b] = (grad_z @ weight.to(dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_z.t() @ h.to(dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    group=None,
) -> tuple[Tensor, Tensor]:
    """(logp [T], entropy [T]) in float32 for ``hidden`` [T, H] against this rank's head shard
    ``weight`` [V/tp, H] (rows ``vocab_start ..``); targets < 0 give logp 0 and no gradient.
    Pass ``hidden`` through ``copy_to_tensor_model_parallel_region`` first when ``group`` has
    several ranks (see the module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape or hidden.dim() != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [T, H] with targets [T], got {tuple(targets.shape)}"
        )
    return VocabParallelLogProbs.apply(
        hidden, weight, targets, int(vocab_start), float(temperature), int(chunk_size), group
    )
