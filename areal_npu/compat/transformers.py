"""transformers patches for packed (THD) training.

Why (transformers 5.19, checked 2026-11): the Gated DeltaNet layers of hybrid Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next models forward ``cu_seq_lens_q`` to ``causal_conv1d_fn`` and ``chunk_gated_delta_rule``,
but only the optional CUDA kernels (causal-conv1d, flash-linear-attention) read it. The pure
PyTorch fallbacks -- the path on CPU and on Ascend -- swallow it in ``**kwargs``: the depthwise
conv window and the recurrent state run straight across segment boundaries, so a packed sequence
sees the one before it (invariant 3 of docs/DESIGN.md broken).

The patch wraps each such layer's ``forward``: when ``cu_seq_lens_q`` is given, there is no cache
and the batch is one packed row, the original forward runs once per segment (state starts at zero
in each, exactly as for a sequence run alone) and the outputs are concatenated. Every other op in
the layer is per token, so this is exact. It costs one Python-level call per segment per layer,
which is fine for training micro-batches (tens of segments); a fused varlen kernel would remove it.

``tests/compat/test_transformers.py`` fails when upstream's torch path starts honouring
``cu_seq_lens_q`` (then delete this patch).
"""

from __future__ import annotations

import functools
import importlib

import torch

__all__ = ["LINEAR_ATTENTION_CLASSES", "patch_linear_attention_for_packing", "unpatched_forward"]

# (module, class) of linear-attention layers whose torch path ignores cu_seq_lens_q.
LINEAR_ATTENTION_CLASSES = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
)

# Keys that describe the packing; the per-segment call must not see them.
_PACKING_KWARGS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "position_ids",
    "seq_idx",
)
_ORIGINAL = "_areal_npu_original_forward"


def _segmented(original):
    @functools.wraps(original)
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None and cache_params is not None and cu.numel() > 2:
            raise ValueError(
                "packed input (cu_seq_lens_q) with a recurrent cache: call the model with use_cache=False"
            )
        if cu is None or cache_params is not None or hidden_states.shape[0] != 1:
            return original(
                self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
            )
        rest = {k: v for k, v in kwargs.items() if k not in _PACKING_KWARGS}
        bounds = [int(x) for x in cu.tolist()]
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                mask = None if attention_mask is None else attention_mask[:, a:b]
                outs.append(
                    original(self, hidden_states[:, a:b], cache_params=None, attention_mask=mask, **rest)
                )
        return torch.cat(outs, dim=1)

    setattr(forward, _ORIGINAL, original)
    return forward


def patch_linear_attention_for_packing() -> list[str]:
    """Wrap every importable class in :data:`LINEAR_ATTENTION_CLASSES` once; returns their names."""
    patched = []
    for module_name, class_name in LINEAR_ATTENTION_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if not hasattr(cls.forward, _ORIGINAL):
            cls.forward = _segmented(cls.forward)
        patched.append(class_name)
    return patched


def unpatched_forward(cls: type):
    """The class's forward as upstream wrote it (for tests and for undoing the patch)."""
    return getattr(cls.forward, _ORIGINAL, cls.forward)
