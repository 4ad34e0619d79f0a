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
