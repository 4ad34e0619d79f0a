"""The reason for areal_npu/rollout/dense_mtp.py still exists upstream: vLLM refuses to draft a
Qwen3 (dense) checkpoint with ``qwen3_5_mtp`` (``Qwen3_5MTP``) in place. Fails once it does: then
serve the policy directory as it is and drop the split."""

from __future__ import annotations

import pytest

from tests.test_megatron_drafter import _checkpoint


@pytest.mark.vllm
def test_vllm_still_refuses_a_qwen3_target_with_an_mtp_drafter(tmp_path):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    model = _checkpoint(tmp_path)
    args = EngineArgs(model=str(model), dtype="float32", speculative_config={"method": "qwen3_5_mtp", "num_speculative_tokens": 1})  # fmt: skip
    with pytest.raises(NotImplementedError, match="Unsupported speculative method: 'mtp'"):
        args.create_engine_config()
