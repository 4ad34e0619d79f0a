"""Speculation "off" without speculation's per-step costs when K = 0 (vLLM 0.32).

Three patches, all inert unless the engine was started with adaptive speculation (the server
sets ``SKIP_ENV``), each equivalent in what is sampled:

1. ``SpecDecodeBaseProposer.propose``: no drafter forward at K = 0 (below);
2. ``GPUModelRunner._sample``: a step with no draft tokens at all is sampled by the plain sampler
   instead of a rejection-sampler pass over zero drafts (same logits rows, same sampler
   settings, same log-prob mode) -- ~12 % of the worker's time per step on the tiny model;
3. ``EngineCore.post_step``: after a step scheduled with K = 0 the engine core does not ask the
   worker for draft tokens (one more inter-process round trip per step). Nothing is lost: the
   scheduler already cleared every request's draft tokens when it scheduled that step, and a
   K = 0 step produces none.

With all three, k = 0 inside a speculative engine is measured against an engine started without
speculation in docs/BENCHMARKS.md.

Why patch 1: vLLM's dynamic speculative decoding (the mechanism ``areal_npu.speculation.k_driver`` uses to
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
or holds earlier requests' finite values. ``rollout.spec.off_keeps_drafter_kv: true`` keeps vLLM's
behaviour (none of the three patches is applied).

Patches 1-2 are applied in the worker process (``areal_npu.rollout.worker_ext`` calls
:func:`apply`), patch 3 in the engine-core process (``areal_npu.speculation.k_driver`` calls
:func:`apply_engine_core` when vLLM builds the scheduler). ``tests/compat/vllm/test_spec_off.py``
checks that the reasons still exist upstream and that each patched call does what the unpatched
one does minus the skipped work; the engine tests compare outputs and log-probs with transformers.
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


def plain_sampling_wrapper(original):
    """``_sample`` that hands a step without any draft token to the plain sampler."""

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample._areal_skip_at_k0 = True
    return _sample


def post_step_wrapper(original):
    """``post_step`` that skips fetching draft tokens after a step the scheduler ran with K = 0."""

    @functools.wraps(original)
    def post_step(self, model_executed: bool) -> None:
        if getattr(self.scheduler, "areal_last_k", None) == 0:
            return None
        return original(self, model_executed)

    post_step._areal_skip_at_k0 = True
    return post_step


def _patch(cls, name: str, wrapper) -> None:
    if not getattr(getattr(cls, name), "_areal_skip_at_k0", False):
        setattr(cls, name, wrapper(getattr(cls, name)))


def apply() -> bool:
    """Worker process: patches 1 and 2, when the engine asked for them; idempotent."""
    if os.environ.get(SKIP_ENV) != "1" or _state["applied"]:
        return _state["applied"]
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _patch(SpecDecodeBaseProposer, "propose", skip_wrapper)
    _patch(GPUModelRunner, "_sample", plain_sampling_wrapper)
    _state["applied"] = True
    return True


def apply_engine_core() -> bool:
    """Engine-core process: patch 3, when the engine asked for it; idempotent."""
    if os.environ.get(SKIP_ENV) != "1":
        return False
    from vllm.v1.engine.core import EngineCore

    _patch(EngineCore, "post_step", post_step_wrapper)
    return True

