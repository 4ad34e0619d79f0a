"""The K = 0 drafter skip (areal_npu/compat/vllm_spec_off.py): the reason still exists upstream,
the patched call answers like upstream's K = 0 branch, and it is applied only on request."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from areal_npu.compat import vllm_spec_off


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

    propose = vllm_spec_off.skip_wrapper(original)
    drafter = SimpleNamespace(num_speculative_tokens=2, _last_draft_probs="stale")
    kwargs = dict(common_attn_metadata=SimpleNamespace(batch_size=lambda: 3), target_token_ids=torch.zeros(7))
    out = propose(drafter, num_speculative_tokens=0, **kwargs)
    # upstream's K = 0 branch: torch.empty(batch_size, 0, dtype=torch.int64)
    assert out.shape == (3, 0) and out.dtype == torch.int64 and calls == []
    assert drafter.num_speculative_tokens == 0 and drafter._last_draft_probs is None
    assert propose(drafter, num_speculative_tokens=2, **kwargs).shape == (3, 2) and calls == [2]


def test_apply_only_when_the_engine_asks(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    original = SpecDecodeBaseProposer.propose
    monkeypatch.setattr(SpecDecodeBaseProposer, "propose", original)
    monkeypatch.setitem(vllm_spec_off._state, "applied", False)
    monkeypatch.delenv(vllm_spec_off.SKIP_ENV, raising=False)
    assert vllm_spec_off.apply() is False and SpecDecodeBaseProposer.propose is original
    monkeypatch.setenv(vllm_spec_off.SKIP_ENV, "1")
    assert vllm_spec_off.apply() is True
    assert SpecDecodeBaseProposer.propose._areal_skip_at_k0 and inspect.unwrap(SpecDecodeBaseProposer.propose) is original
