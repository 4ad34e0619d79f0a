"""The transformers packing patch: still needed upstream, and exact."""

from __future__ import annotations

import torch

from areal_npu.compat.transformers import patch_linear_attention_for_packing, unpatched_forward


def _layer():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(
        hidden_size=32, num_hidden_layers=1, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(cfg, layer_idx=0).eval()


def test_upstream_torch_path_still_ignores_cu_seqlens():
    """Fails once transformers' PyTorch Gated DeltaNet honours cu_seq_lens_q: then drop the patch."""
    layer = _layer()
    original = unpatched_forward(type(layer))
    x = torch.randn(1, 20, 32)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    with torch.no_grad():
        packed = original(layer, x, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        second_alone = original(layer, x[:, 8:])
    assert not torch.allclose(packed[:, 8:], second_alone, rtol=1e-4, atol=1e-5)


def test_patch_restarts_state_at_every_segment():
    assert "Qwen3_5GatedDeltaNet" in patch_linear_attention_for_packing()
    patch_linear_attention_for_packing()  # idempotent: wraps once
    layer = _layer()
    assert unpatched_forward(type(layer)) is not type(layer).forward
    assert not hasattr(unpatched_forward(type(layer)), "_areal_npu_original_forward")
    x = torch.randn(1, 23, 32)
    cu = torch.tensor([0, 8, 9, 23], dtype=torch.int32)
    with torch.no_grad():
        packed = layer(x, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        alone = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def _hybrid_model():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(cfg).eval()


def _linear_attention_kwargs(model, **inputs) -> dict:
    seen = {}

    def record(module, args, kwargs):
        seen.update(kwargs)

    layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    handle = layer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen


def test_upstream_gives_linear_attention_no_segments_from_position_ids():
    """Fails once transformers hands the Gated DeltaNet something that marks segments when only
    position ids are given: then segment_by_position_ids can go."""
    model = _hybrid_model()
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    seen = _linear_attention_kwargs(model, input_ids=torch.arange(7)[None], position_ids=position_ids)
    assert not {"cu_seq_lens_q", "position_ids", "seq_idx"} & {k for k, v in seen.items() if v is not None}


def test_position_ids_hook_hands_linear_attention_the_segments():
    from areal_npu.compat.transformers import segment_by_position_ids
    from areal_npu.data.packed_layout import cu_seqlens_from_position_ids

    model = _hybrid_model()
    assert segment_by_position_ids(model, cu_seqlens_from_position_ids) == 1
    assert segment_by_position_ids(model, cu_seqlens_from_position_ids) == 1  # idempotent: one hook per stack
    assert len(model.model._forward_pre_hooks) == 1
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    seen = _linear_attention_kwargs(
        model, input_ids=torch.arange(7)[None], position_ids=position_ids, use_cache=False
    )
    assert seen["cu_seq_lens_q"].tolist() == [0, 3, 7]
    assert seen["max_length_q"] == 4
    # One sequence (generation, a plain batch) is left alone.
    seen = _linear_attention_kwargs(model, input_ids=torch.arange(7)[None], use_cache=False)
    assert seen.get("cu_seq_lens_q") is None
