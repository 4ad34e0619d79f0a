"""The K = 0 patches (areal_npu/compat/vllm/spec_off.py): each reason still exists upstream, each
patched call does what upstream does minus the skipped work, and they apply only on request."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from areal_npu.compat.vllm import spec_off


def test_upstream_still_runs_the_drafter_forward_at_k0():
    """Fails once vLLM stops running the drafter forward before its K = 0 early return."""
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    source = inspect.getsource(inspect.unwrap(SpecDecodeBaseProposer.propose))
    forward = source.index("self.model(")
    k0_return = source.index("if self.num_speculative_tokens == 0:")
    assert forward < k0_return


def test_patched_propose_skips_only_k0():
    calls = []

    def original(self, num_speculative_tokens, **kwargs):
        calls.append(num_speculative_tokens)
        return torch.zeros(3, num_speculative_tokens, dtype=torch.int64)

    propose = spec_off.skip_wrapper(original)
    drafter = SimpleNamespace(num_speculative_tokens=2, _last_draft_probs="stale")
    kwargs = dict(common_attn_metadata=SimpleNamespace(batch_size=lambda: 3), target_token_ids=torch.zeros(7))
    out = propose(drafter, num_speculative_tokens=0, **kwargs)
    # upstream's K = 0 branch: torch.empty(batch_size, 0, dtype=torch.int64)
    assert out.shape == (3, 0) and out.dtype == torch.int64 and calls == []
    assert drafter.num_speculative_tokens == 0 and drafter._last_draft_probs is None
    assert propose(drafter, num_speculative_tokens=2, **kwargs).shape == (3, 2) and calls == [2]


def test_upstream_sends_any_spec_step_through_the_rejection_sampler_and_fetches_drafts():
    """Fails once vLLM samples draft-less steps plainly or stops fetching drafts after K = 0 steps."""
    pytest.importorskip("vllm")
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = inspect.getsource(inspect.unwrap(GPUModelRunner._sample))
    assert "if spec_decode_metadata is None:" in sample and "self.rejection_sampler(" in sample
    assert "max_spec_len" not in sample
    post_step = inspect.getsource(inspect.unwrap(EngineCore.post_step))
    assert "take_draft_token_ids()" in post_step and "num_spec_tokens" not in post_step


def test_plain_sampling_only_without_drafts():
    seen = []
    sample = spec_off.plain_sampling_wrapper(lambda self, logits, meta: seen.append(meta) or "out")
    no_drafts, drafts = SimpleNamespace(max_spec_len=0), SimpleNamespace(max_spec_len=2)
    assert sample(None, "logits", no_drafts) == "out" and seen[-1] is None
    assert sample(None, "logits", drafts) == "out" and seen[-1] is drafts
    assert sample(None, "logits", None) == "out" and seen[-1] is None


def test_post_step_skips_the_draft_fetch_only_after_k0():
    calls = []
    post_step = spec_off.post_step_wrapper(lambda self, executed: calls.append(executed))
    for last_k, fetched in ((0, False), (2, True), (None, True)):
        calls.clear()
        post_step(SimpleNamespace(scheduler=SimpleNamespace(areal_last_k=last_k)), True)
        assert calls == ([True] if fetched else []), last_k
    calls.clear()
    post_step(SimpleNamespace(scheduler=SimpleNamespace()), True)  # vLLM's own scheduler
    assert calls == [True]


def test_apply_only_when_the_engine_asks(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    originals = {
        (SpecDecodeBaseProposer, "propose"): SpecDecodeBaseProposer.propose,
        (GPUModelRunner, "_sample"): GPUModelRunner._sample,
        (EngineCore, "post_step"): EngineCore.post_step,
    }
    for (cls, name), fn in originals.items():
        monkeypatch.setattr(cls, name, fn)
    monkeypatch.setitem(spec_off._state, "applied", False)
    monkeypatch.delenv(spec_off.SKIP_ENV, raising=False)
    assert spec_off.apply() is False and spec_off.apply_engine_core() is False
    assert all(getattr(cls, name) is fn for (cls, name), fn in originals.items())
    monkeypatch.setenv(spec_off.SKIP_ENV, "1")
    assert spec_off.apply() is True and spec_off.apply_engine_core() is True
    assert spec_off.apply() is True and spec_off.apply_engine_core() is True  # idempotent
    for (cls, name), fn in originals.items():
        patched = getattr(cls, name)
        assert patched._areal_skip_at_k0 and inspect.unwrap(patched) is fn
