"""transformers patches for packed (THD) training.

Why (transformers 5.9 to 5.19, checked 2026-11; before 5.9 the decoder layer does not even hand
``cu_seq_lens_q`` to the Gated DeltaNet, hence pyproject's lower bound; 5.24 raises there
instead of leaking): the Gated DeltaNet layers of hybrid Qwen3.5 / Qwen3.5-MoE /
Qwen3-Next models forward ``cu_seq_lens_q`` to ``causal_conv1d_fn`` and ``chunk_gated_delta_rule``,
but only the optional CUDA kernels (causal-conv1d, flash-linear-attention) read it. The pure
PyTorch fallbacks -- the path on CPU and on Ascend -- swallow it in ``**kwargs``: the depthwise
conv window and the recurrent state run straight across segment boundaries, so a packed sequence
sees the one before it (and packed segments must never see each other).

The patch wraps each such layer's ``forward``: when ``cu_seq_lens_q`` is given, there is no cache
and the batch is one packed row, the original forward runs once per segment (state starts at zero
in each, exactly as for a sequence run alone) and the outputs are concatenated. Every other op in
the layer is per token, so this is exact. It costs one Python-level call per segment per layer,
which is fine for training micro-batches (tens of segments); a fused varlen kernel would remove it.

``tests/compat/test_transformers.py`` fails when upstream's torch path starts honouring
``cu_seq_lens_q`` (then delete this patch).

Position ids alone (no ``cu_seq_lens_q``; e.g. ``DataCollatorWithFlattening`` without
``return_flash_attn_kwargs``) mark segments for the attention layers, but never reach the Gated
DeltaNet: the decoder layer hands it only ``**kwargs``, not ``position_ids``. So
:func:`segment_by_position_ids` hooks a model's decoder stacks that hold linear-attention layers
and turns position ids restarting at 0 into ``cu_seq_lens_q/k`` before the layers run; every layer
type then sees the same segments. A forward pre-hook on the given model only, not a class patch.
"""

from __future__ import annotations

import functools
import importlib

import torch

__all__ = [
    "LINEAR_ATTENTION_CLASSES",
    "patch_linear_attention_for_packing",
    "segment_by_position_ids",
    "unpatched_forward",
]

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


_HOOKED = "_areal_npu_segments_from_position_ids"


def _segments_from_position_ids(cu_seqlens_of, module, args, kwargs):
    """Forward pre-hook: ``position_ids`` restarting at 0 in a one-row batch -> ``cu_seq_lens_q/k``
    (``cu_seqlens_of``: position ids -> int32 segment boundaries, the caller's packed layout)."""
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("attention_mask") is not None:
        return None  # explicit boundaries, or a padding mask that defines the rows itself
    if kwargs.get("past_key_values") is not None:
        return None  # decoding continues one sequence
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return None
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:
        position_ids = position_ids[0]  # Qwen3.5's [text; temporal; height; width] layout: row 0 is text
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None  # a batch of several rows: each row is one sequence
    cu = cu_seqlens_of(position_ids)
    if cu.numel() <= 2:
        return None  # one segment: nothing to split
    longest = int((cu[1:] - cu[:-1]).max())
    kwargs = {
        **kwargs,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    if kwargs.get("use_cache") is None:
        # The config's default cache cannot continue a row of several sequences; an explicit
        # use_cache=True still reaches the Gated DeltaNet wrapper, which refuses it.
        kwargs["use_cache"] = False
    return args, kwargs


def segment_by_position_ids(model: torch.nn.Module, cu_seqlens_of) -> int:
    """Hook every decoder stack of ``model`` that holds linear-attention layers (a ``layers`` list
    with a ``linear_attn`` member) so position ids alone segment them; returns how many it hooked.
    Idempotent. Pass ``position_ids`` as a keyword (transformers' own callers do).

    ``cu_seqlens_of`` turns position ids into ``cu_seqlens`` (``[starts..., T]``, int32): the
    packed layout is the caller's (``areal_npu.data.packed_layout.cu_seqlens_from_position_ids``),
    handed in because compat imports nothing of the project."""
    hooked = 0
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            continue
        if not any(hasattr(layer, "linear_attn") for layer in layers):
            continue
        if not getattr(module, _HOOKED, False):
            hook = functools.partial(_segments_from_position_ids, cu_seqlens_of)
            module.register_forward_pre_hook(hook, with_kwargs=True)
            setattr(module, _HOOKED, True)
        hooked += 1
    return hooked
