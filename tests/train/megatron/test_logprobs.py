"""The Megatron engine's log-prob kernel on a bf16 head: a bf16 GEMM accumulated in float32 (no
float32 copy of the head), the softmax in float32, within bf16's bound of a float64 reference.

Bound: the device's half GEMM accumulates in float32; at worst (the NPU, the CPU) its output is
rounded to bf16 once, ``|δz| <= 2^-8 |z|``. A log-prob ``z_y - lse`` then moves by at most
``2 max|δz|``; the entropy by ``Σ p |log p + H| max|δz| <= 2 H max|δz|`` (to first order). The gradients also see
``∂/∂z`` and their outputs rounded to bf16 (``2^-8`` each) and ``p`` moved by ``2 max|δz|``
relative. Where the GEMM has a float32 output (CUDA) the errors are far smaller."""

import math

import torch
from areal_npu.kernels.logprobs import naive_logprobs_entropy
from torch.utils._python_dispatch import TorchDispatchMode

from areal_npu.train.megatron.logprobs import vocab_parallel_logprobs_entropy
from tests.support.device import test_device

T, H, V, TAU = 37, 64, 300, 0.8
U = 2.0**-8  # bf16 unit roundoff


def _inputs():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (0.3 * torch.randn(V, H, generator=g)).bfloat16()
    targets = torch.randint(0, V, (T,), generator=g)
    targets[3] = -100
    up = torch.randn(2, T, generator=g)
    return [t.to(test_device()) for t in (hidden, weight, targets, up)]


def _rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def test_bf16_head_within_bf16_bound_of_a_float64_reference():
    hidden, weight, targets, up = _inputs()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs_entropy(h, w, targets, temperature=TAU, chunk_size=16)
    assert logp.dtype == ent.dtype == torch.float32
    ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16

    h64 = hidden.double().requires_grad_()  # the same bf16 values, exactly
    w64 = weight.double().requires_grad_()
    lp_ref, ent_ref = naive_logprobs_entropy(h64, w64, targets, temperature=TAU)
    ((lp_ref * up[0]).sum() + (ent_ref * up[1]).sum()).backward()

    dz = U * float((h64 @ w64.t()).detach().abs().max()) / TAU  # |δz| bound of one rounding
    assert (logp.double() - lp_ref).abs().max() <= 2 * dz
    entropy_bound = 2 * float(ent_ref.detach().max()) * dz  # H <= log V
    assert (ent.double() - ent_ref).abs().max() <= entropy_bound <= 2 * math.log(V) * dz
    grad_bound = 3 * U + 4 * dz  # ∂/∂z and output rounding, p's relative move, with slack
    assert _rel(h.grad, h64.grad) <= grad_bound
    assert _rel(w.grad, w64.grad) <= grad_bound


class _HeadRecorder(TorchDispatchMode):
    """Every op that reads the head's storage: matmuls (with their input dtypes) and any op that
    makes a float32 tensor of the head's size from it (an upcast copy)."""

    def __init__(self, weight):
        super().__init__()
        self.ptr, self.numel = weight.untyped_storage().data_ptr(), weight.numel()
        self.gemms, self.copies = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads = [
            a for a in args if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr
        ]
        if reads:
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm", "matmul", "bmm", "linear"):
                self.gemms.append((name, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
            outs = out if isinstance(out, (tuple, list)) else [out]
            for o in outs:
                if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.numel() >= self.numel:
                    self.copies.append(name)
        return out


def test_no_float32_copy_of_the_head_and_every_gemm_in_bf16():
    hidden, weight, targets, up = _inputs()
    w = weight.clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    with _HeadRecorder(w) as rec:
        logp, ent = vocab_parallel_logprobs_entropy(h, w, targets, temperature=TAU, chunk_size=16)
        ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
    # forward 3 chunks, backward 3 recomputed + 3 for ∂h (∂W's GEMMs read h and ∂z, not W)
    assert len(rec.gemms) == 9, rec.gemms
    assert all(dtypes == [torch.bfloat16, torch.bfloat16] for _, dtypes in rec.gemms), rec.gemms
    assert rec.copies == []

    with _HeadRecorder(w) as control:  # the recorder sees an upcast copy when there is one
        w.detach().float()
    assert control.copies == ["_to_copy"]
