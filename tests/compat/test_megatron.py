"""The Megatron-Core CPU shims: each one still needed upstream (the test fails once it is not), and exact."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are for CPU-only torch builds"),
]

from areal_npu.compat.megatron import CPU_DEVICE_SHIMS, apply_cpu_patches, unpatched  # noqa: E402

ROTARY = ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb")


def _rotary():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)


def test_upstream_rotary_still_moves_inv_freq_to_cuda():
    """Fails once Megatron's RotaryEmbedding.get_emb runs on a CPU-only build: then drop the shim."""
    rotary = _rotary()
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        unpatched(*ROTARY)(rotary, 4)


def test_patched_rotary_is_the_rope_table_on_the_cpu():
    assert "{}.{}".format(*ROTARY) in apply_cpu_patches()
    assert apply_cpu_patches() == apply_cpu_patches()  # idempotent: one wrapper
    rotary = _rotary()
    emb = rotary.get_emb(5)  # [positions, 1, 1, dim], non-interleaved: cat(freqs, freqs)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    freqs = torch.arange(5, dtype=torch.float32)[:, None] * inv_freq[None]
    torch.testing.assert_close(emb[:, 0, 0], torch.cat([freqs, freqs], -1), rtol=0, atol=0)
    assert emb.device.type == "cpu" and rotary.inv_freq.device.type == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):  # the stand-in lives only inside the call
        torch.cuda.current_device()


def test_every_shim_is_listed_with_a_reason_and_applied():
    applied = apply_cpu_patches()
    for module, path, why in CPU_DEVICE_SHIMS:
        assert why and f"{module}.{path}" in applied
        assert unpatched(module, path) is not None
