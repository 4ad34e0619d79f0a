"""A packed micro-batch through HF causal LMs equals each sequence run alone (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_npu.data.packed_layout import pack_sequences, unpack_per_token
from areal_npu.model.packed import (
    ATTN_IMPLEMENTATION,
    enable_packed_attention,
    hf_packed_attention,
    packed_forward_kwargs,
    packed_shift_labels,
    packed_token_logprobs,
)

VOCAB = 97
LENGTHS = [27, 7, 13, 4, 1]


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa",
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


def tiny_qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return Qwen3_5ForCausalLM(cfg)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("factory", [tiny_qwen3, tiny_qwen3_5], ids=["qwen3", "qwen3_5_hybrid"])
def test_packed_logits_and_loss_equal_each_sequence_alone(factory):
    torch.manual_seed(0)
    model = factory().eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        # independent reference: the stock model (sdpa, unpatched), one sequence per call
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        alone_loss_sum = sum(
            F.cross_entropy(lg[:-1], s[1:], reduction="sum") for lg, s in zip(alone, seqs) if len(s) > 1
        )
        enable_packed_attention(model)
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        batch = pack_sequences(seqs, alignment=8)  # forces an alignment-padding segment
        assert batch.alignment_pad_tokens > 0
        kwargs = packed_forward_kwargs(batch)
        shift = packed_shift_labels(batch.input_ids, batch.cu_seqlens)
        shift[~batch.valid_mask] = -100
        out = model(**kwargs, labels=batch.input_ids[None], shift_labels=shift[None])
    logits = out.logits[0]
    for j, (packed, ref) in enumerate(zip(unpack_per_token(logits, batch), alone)):
        assert rel_err(packed, ref) <= 1e-5, f"sequence {j}"
    n_targets = sum(len(s) - 1 for s in seqs)
    assert float(out.loss) == pytest.approx(float(alone_loss_sum) / n_targets, rel=1e-5)
    logp = packed_token_logprobs(logits, batch.input_ids, batch.cu_seqlens)
    assert float(-(logp * batch.valid_mask).sum()) == pytest.approx(float(alone_loss_sum), rel=1e-5)


def test_unpatched_hybrid_model_would_leak_across_segments():
    """Guards the test above: without the packing patch the Qwen3.5 outputs really differ."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from areal_npu.compat.transformers import unpatched_forward

    torch.manual_seed(0)
    model = tiny_qwen3_5().eval()
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (9, 12)]
    enable_packed_attention(model)
    batch = pack_sequences(seqs)
    patched = Qwen3_5GatedDeltaNet.forward
    with torch.no_grad():
        good = model(**packed_forward_kwargs(batch)).logits[0, 9:]
        Qwen3_5GatedDeltaNet.forward = unpatched_forward(Qwen3_5GatedDeltaNet)
        try:
            leaky = model(**packed_forward_kwargs(batch)).logits[0, 9:]
        finally:
            Qwen3_5GatedDeltaNet.forward = patched
    assert rel_err(leaky, good) > 1e-3


def test_packed_gradients_equal_per_sequence_gradients():
    torch.manual_seed(0)
    model = tiny_qwen3()
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (11, 5, 8)]
    loss = sum(F.cross_entropy(model(input_ids=s[None]).logits[0, :-1], s[1:], reduction="sum") for s in seqs)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    enable_packed_attention(model)
    batch = pack_sequences(seqs, alignment=4)
    logits = model(**packed_forward_kwargs(batch)).logits[0]
    (-(packed_token_logprobs(logits, batch.input_ids, batch.cu_seqlens) * batch.valid_mask).sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_position_ids_alone_mark_the_segments():
    """Without cu_seq_lens (DataCollatorWithFlattening with only position_ids), segments still hold."""
    torch.manual_seed(0)
    model = tiny_qwen3().eval()
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (6, 10)]
    with torch.no_grad():
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
        enable_packed_attention(model)
        batch = pack_sequences(seqs)
        logits = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]).logits[0]
    for packed, ref in zip(unpack_per_token(logits, batch), alone):
        assert rel_err(packed, ref) <= 1e-5


def test_position_ids_alone_segment_a_hybrid_model():
    """Gated DeltaNet and attention layers both restart where position ids restart at 0, with no
    cu_seq_lens given; the reference is the stock model (sdpa) on each sequence alone."""
    torch.manual_seed(0)
    model = tiny_qwen3_5().eval()
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (9, 14, 5)]
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        enable_packed_attention(model)
        batch = pack_sequences(seqs)
        logits = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]).logits[0]
    for j, (packed, ref) in enumerate(zip(unpack_per_token(logits, batch), alone)):
        assert rel_err(packed, ref) <= 1e-5, f"sequence {j}"


def tiny_qwen3_sliding(window: int | None):
    """Qwen3 whose layers all use a sliding window of ``window`` tokens (None: full attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kind = "full_attention" if window is None else "sliding_attention"
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa",
        use_sliding_window=window is not None, sliding_window=window, max_window_layers=0,
        layer_types=[kind, kind],
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("cu_kwargs", [True, False], ids=["cu_seqlens", "position_ids_only"])
def test_sliding_window_covering_every_segment_is_causal_attention(cu_kwargs):
    """transformers' window W shows a query its last W tokens (itself included); a segment of
    length L <= W never reaches past it. Reference: the stock sdpa model, which applies the window,
    on each sequence alone."""
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    window = max(LENGTHS)
    model = tiny_qwen3_sliding(window)
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        enable_packed_attention(model)
        batch = pack_sequences(seqs)
        if cu_kwargs:
            logits = model(**packed_forward_kwargs(batch)).logits[0]
        else:
            logits = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]).logits[0]
    for j, (packed, ref) in enumerate(zip(unpack_per_token(logits, batch), alone)):
        assert rel_err(packed, ref) <= 1e-5, f"sequence {j}"


def test_sliding_window_shorter_than_a_segment_is_refused():
    longest = max(LENGTHS)
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    model = tiny_qwen3_sliding(longest - 1)
    causal_model = tiny_qwen3_sliding(None)
    causal_model.load_state_dict(model.state_dict())
    longest_seq = seqs[LENGTHS.index(longest)][None]
    with torch.no_grad():
        windowed = model(input_ids=longest_seq, use_cache=False).logits[0]
        causal = causal_model(input_ids=longest_seq, use_cache=False).logits[0]
    # Guards the boundary: at W = L - 1 transformers' own window already masks a key.
    assert rel_err(windowed, causal) > 1e-4
    model = enable_packed_attention(model)
    batch = pack_sequences(seqs)
    with pytest.raises(NotImplementedError, match="sliding_window=26 is shorter than the longest"):
        with torch.no_grad():
            model(**packed_forward_kwargs(batch))


def test_padding_mask_path_matches_sdpa():
    """A right- and left-padded batch with a 2-D mask: padded rows are dropped before attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    module = torch.nn.Module()
    out, _ = hf_packed_attention(module, q, k, v, mask)
    for b in range(2):
        keep = mask[b].nonzero().view(-1)
        ref = F.scaled_dot_product_attention(q[b : b + 1, :, keep], k[b : b + 1, :, keep], v[b : b + 1, :, keep],
                                             is_causal=True, enable_gqa=True)  # fmt: skip
        torch.testing.assert_close(out[b, keep], ref[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
        assert out[b, ~mask[b]].abs().sum() == 0
