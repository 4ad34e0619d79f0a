"""Which MTP layer each draft depth uses: training must follow what vLLM serves.

The reference is vLLM's own module: its drafter forward (``Qwen3_5MTP.forward`` around
``Qwen3_5MultiTokenPredictor.forward``) runs on stand-in layers that record which one was called,
for each ``spec_step_idx`` a proposer could pass. No engine starts; importing vLLM takes seconds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_npu.model.mtp import vllm_draft_layer_index

HIDDEN = 4


class _RecordingLayer(torch.nn.Module):
    """Stands in for a vLLM decoder layer: records its index, passes the hidden state through."""

    use_attn_reduce_scatter_for_moe = False

    def __init__(self, index: int, calls: list[int]):
        super().__init__()
        self.index, self.calls = index, calls

    def forward(self, positions, hidden_states, residual):
        self.calls.append(self.index)
        return hidden_states, residual


def vllm_module(monkeypatch):
    """vLLM's Qwen3.5 MTP module, with pipeline parallelism stubbed to one (last) stage."""
    module = pytest.importorskip("vllm.model_executor.models.qwen3_5_mtp")
    monkeypatch.setattr(module, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True))
    return module


def stand_in_predictor(num_layers: int, calls: list[int]) -> SimpleNamespace:
    """The attributes ``Qwen3_5MultiTokenPredictor.forward`` reads, with recording layers."""
    return SimpleNamespace(
        embed_input_ids=lambda ids: torch.zeros(ids.shape[0], HIDDEN),
        pre_fc_norm_embedding=torch.nn.Identity(),
        pre_fc_norm_hidden=torch.nn.Identity(),
        fc=lambda x: x[..., :HIDDEN],
        layers=[_RecordingLayer(i, calls) for i in range(num_layers)],
        num_mtp_layers=num_layers,
        norm=lambda hidden, residual: (hidden, residual),
    )


def vllm_layer_used(num_layers: int, spec_step_idx: int | None, monkeypatch) -> int:
    """The index of the MTP layer vLLM's drafter (``Qwen3_5MTP.forward``) runs for one draft step."""
    qwen3_5_mtp = vllm_module(monkeypatch)
    calls: list[int] = []
    predictor = stand_in_predictor(num_layers, calls)
    predictor_forward = qwen3_5_mtp.Qwen3_5MultiTokenPredictor.forward
    drafter = SimpleNamespace(model=lambda *args, **kwargs: predictor_forward(predictor, *args, **kwargs))
    step = {} if spec_step_idx is None else {"spec_step_idx": spec_step_idx}
    qwen3_5_mtp.Qwen3_5MTP.forward(
        drafter,
        input_ids=torch.zeros(2, dtype=torch.long),
        positions=torch.arange(2),
        hidden_states=torch.zeros(2, HIDDEN),
        **step,
    )
    assert len(calls) == 1
    return calls[0]


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_training_uses_the_layer_vllm_drafts_with_at_every_depth(num_layers, monkeypatch):
    for depth in range(1, 5):
        # vLLM's base proposer passes no spec_step_idx; a proposer that did would pass depth - 1.
        for spec_step_idx in (None, depth - 1):
            served = vllm_layer_used(num_layers, spec_step_idx, monkeypatch)
            assert vllm_draft_layer_index(depth, num_layers) == served, (depth, spec_step_idx)


def test_the_probe_can_tell_a_per_step_rule_apart(monkeypatch):
    """Guards the probe: vLLM's predictor itself does pick layers[spec_step_idx % n]; it is the
    drafter wrapper around it that drops the index."""
    qwen3_5_mtp = vllm_module(monkeypatch)
    calls: list[int] = []
    qwen3_5_mtp.Qwen3_5MultiTokenPredictor.forward(
        stand_in_predictor(2, calls),
        torch.zeros(2, dtype=torch.long),
        torch.arange(2),
        torch.zeros(2, HIDDEN),
        spec_step_idx=1,
    )
    assert calls == [1]
