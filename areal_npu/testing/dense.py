"""A tiny dense Qwen3 (the layer the Megatron engine maps) for tests and benchmarks.

Norm weights are perturbed away from 1 so that a mis-mapped norm changes the logits.
"""

from __future__ import annotations

import torch


def perturbed_qwen3(config, seed: int = 3):
    """A float32 ``Qwen3ForCausalLM(config)`` in eval mode, seeded, with every norm weight moved by
    0.2 N(0, 1) noise."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model
