"""The MTP loss through the chunked log-prob kernel: the old full-logits formula's values and
gradients, and a peak memory far below one ``[T, V]`` float32 logits tensor at 16K x 64K.

The reference here is the formula the loss had before it was chunked, written out in full:
``F.linear(h, W).float()`` logits for the rows that carry loss, ``F.cross_entropy(reduction="sum")``
over the per-depth count, argmax accuracy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_npu import names
from areal_npu.model.mtp_loss import mtp_loss
from areal_npu.model.mtp_targets import MTPTargets
from tests.support.peak_memory import peak_memory


def _targets(labels: torch.Tensor) -> MTPTargets:
    return MTPTargets(embed_ids=labels.clamp(min=0), labels=labels, mask=labels != -100)


def naive_full_logits_mtp_loss(hidden, weight, labels, loss_scale, counts):
    """The pre-chunking formula: full float32 ``[N_d, V]`` logits per depth."""
    total, stats = 0.0, {}
    for d, (h, lab) in enumerate(zip(hidden, labels), start=1):
        keep = lab != -100
        logits = F.linear(h[keep], weight.detach()).float()
        ce = F.cross_entropy(logits, lab[keep], reduction="sum")
        loss_d = ce / counts[d - 1]
        stats[f"mtp/loss_d{d}"] = float(loss_d.detach())
        stats[f"mtp/acc_d{d}"] = float((logits.argmax(-1) == lab[keep]).sum()) / counts[d - 1]
        stats[f"mtp/n_d{d}"] = float(keep.sum())
        total = total + loss_d
    return total * (loss_scale / len(hidden)), stats


def _case(T=53, H=16, V=97, depths=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(T, H, generator=g).to(dtype).requires_grad_() for _ in range(depths)]
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (depths, T), generator=g)
    labels[0, ::5] = -100
    labels[depths - 1, ::3] = -100
    with torch.no_grad():  # a few rows predict their own argmax, so the accuracy is not trivially 0
        first = F.linear(hidden[0][:10].float(), weight.float()).argmax(-1)
        labels[0, 1:10:2] = first[1:10:2]
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [7, 2048])
@pytest.mark.parametrize("global_counts", [False, True])
def test_loss_stats_and_gradients_equal_the_full_logits_formula(chunk_size, global_counts):
    hidden, weight, labels = _case()
    local = [int((lab != -100).sum()) for lab in labels]
    counts = [c + 11 for c in local] if global_counts else local
    loss, stats = mtp_loss(
        hidden, weight, _targets(labels), 0.3, counts if global_counts else None, chunk_size=chunk_size
    )
    loss.backward()
    grads = [h.grad.clone() for h in hidden]
    assert weight.grad is None  # the shared output head never gets gradient from the MTP loss
    for h in hidden:
        h.grad = None
    ref_loss, ref_stats = naive_full_logits_mtp_loss(hidden, weight, labels, 0.3, counts)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, h in zip(grads, hidden):
        torch.testing.assert_close(g, h.grad, rtol=1e-5, atol=1e-7)
    assert stats[names.mtp_acc_key(1)] > 0
    for key, value in ref_stats.items():
        assert stats[key] == pytest.approx(value, rel=1e-5), key
    assert stats[names.MTP_LOSS] == pytest.approx(float(ref_loss), rel=1e-5)


def test_bf16_logits_are_accumulated_in_float32():
    """bf16 hidden states and head: the loss equals the float32 formula on the same bf16 values
    (the old formula rounded the logits to bf16 first; that error is visible here)."""
    hidden, weight, labels = _case(T=64, H=32, V=300, depths=1, seed=4, dtype=torch.bfloat16)
    weight = (weight.detach() * 2).bfloat16()
    counts = [int((labels[0] != -100).sum())]
    with torch.no_grad():
        loss, _ = mtp_loss(hidden, weight, _targets(labels), 1.0, chunk_size=16)
        exact, _ = naive_full_logits_mtp_loss([hidden[0].double()], weight.double(), labels, 1.0, counts)
        rounded, _ = naive_full_logits_mtp_loss(hidden, weight, labels, 1.0, counts)  # bf16 GEMM, then float
    assert abs(float(rounded) - float(exact)) > 1e-4
    assert float(loss) == pytest.approx(float(exact), abs=2e-5)


def test_mtp_loss_at_16k_tokens_by_64k_vocab_peaks_far_below_full_logits():
    """T = 16K x V = 64K: one float32 [T, V] logits tensor is 4 GiB (the old formula peaked at
    ~14 GiB here: logits, log-softmax and their gradients). Chunked, the peak is two
    [chunk, V] float32 buffers plus O(T·H): 1.0 GiB at chunk 2048 (measured: 1031 MiB)."""
    T, V, H, chunk = 16384, 65536, 64, 2048
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = torch.randn(V, H, generator=g) / 8
    labels = torch.randint(0, V, (1, T), generator=g)
    labels[0, ::7] = -100
    with peak_memory() as mem:
        loss, stats = mtp_loss([hidden], weight, _targets(labels), chunk_size=chunk)
        loss.backward()
    full_logits = T * V * 4
    chunk_bound = 2 * chunk * V * 4 + 64 * T * H  # two chunk buffers + small [T, H]-sized tensors
    assert mem.peak_bytes <= chunk_bound, (mem.peak_mib, chunk_bound / 2**20)
    assert mem.peak_bytes <= full_logits / 3, (mem.peak_mib, full_logits / 2**20)
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert stats[names.mtp_count_key(1)] == float((labels != -100).sum())
