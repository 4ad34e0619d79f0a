"""Speculation "off" without the drafter's cost: skip the drafter forward when K = 0 (vLLM 0.32).

Why: vLLM's dynamic speculative decoding (the mechanism ``areal_npu.rollout.spec_k`` uses to
change the draft length at runtime) still runs the drafter's first forward pass at K = 0, so
that the drafter's KV cache stays complete and drafting can resume at any step
(``SpecDecodeBaseProposer.propose``: "The prefill forward pass above already ran to keep the
drafter KV cache in sync"). That forward costs one MTP layer per step: ~2 % of a 64-layer
Qwen3.5, but on the 2-layer CPU model it made K = 0 about 45 % slower than an engine without
speculation (docs/BENCHMARKS.md), so "speculation off" could never recover the plain throughput.

The patch returns the empty draft before the forward when K = 0. Cost: positions generated
while speculation is off have no drafter KV; a request that is still running when speculation
comes back drafts from that incomplete cache and gets lower acceptance until it ends (requests
started afterwards are unaffected). Sampling stays exact either way: the rejection sampler
verifies whatever the drafter proposes against the target, and KV memory is zero-initialised
or holds earlier requests' finite values. Opt-out: ``rollout.spec.off_keeps_drafter_kv: true``.

Applied in the worker process (``areal_npu.rollout.worker_ext`` calls :func:`apply` when the
server set ``SKIP_ENV``). ``tests/compat/test_vllm_spec_off.py`` checks that upstream still
runs the forward at K = 0 (the reason) and that the patched call returns what the unpatched
one returns, minus the forward.
"""

from __future__ import annotations

import functools
import os

SKIP_ENV = "AREAL_SPEC_SKIP_DRAFTER_AT_K0"
_state = {"applied": False}


def skip_wrapper(original):
    """``propose`` that answers K = 0 with an empty ``[batch, 0]`` draft and no forward pass."""

    @functools.wraps(original)
    def propose(self, num_speculative_tokens, *args, **kwargs):
        if num_speculative_tokens != 0:
            return original(self, num_speculative_tokens, *args, **kwargs)
        import torch

        metadata = kwargs["common_attn_metadata"]
        target = kwargs["target_token_ids"]
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        return torch.empty(metadata.batch_size(), 0, dtype=torch.int64, device=target.device)

    propose._areal_skip_at_k0 = True
    return propose


def apply() -> bool:
    """Patch vLLM's proposer base class when the engine asked for it; idempotent."""
    if os.environ.get(SKIP_ENV) != "1" or _state["applied"]:
        return _state["applied"]
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if not getattr(SpecDecodeBaseProposer.propose, "_areal_skip_at_k0", False):
        SpecDecodeBaseProposer.propose = skip_wrapper(SpecDecodeBaseProposer.propose)
    _state["applied"] = True
    return True

