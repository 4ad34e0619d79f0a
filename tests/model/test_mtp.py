"""The MTP head: vLLM's computation, gradient isolation, packed labels/masks, loss, modes, checkpoints.

Every check compares against an independent reference: plain per-sequence Python / torch code,
a second forward without the MTP loss, or hand-written zigzag indices.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_npu import names as N
from areal_npu.data.packed_layout import pack_per_token, pack_sequences, unpack_per_token
from areal_npu.model.mtp import (
    MTPConfig,
    Qwen35MTP,
    init_mtp_weights,
    mtp_logits,
    rotary_position_ids,
)
from areal_npu.model.mtp_loss import joint_forward, mtp_loss
from areal_npu.model.mtp_params import apply_mtp_mode, mtp_param_groups, weight_sync_names
from areal_npu.model.mtp_targets import (
    build_mtp_targets,
    build_packed_mtp_targets,
    split_mtp_targets_for_cp,
)
from areal_npu.model.packed import enable_packed_attention
from areal_npu.model.tiny import TinyModelConfig, build_tiny_model

LENGTHS = [13, 5, 9, 3, 1]


def tiny(linear_every: int = 2, mtp_layers: int = 1, seed: int = 0):
    cfg = TinyModelConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_attention_every=linear_every,
        mtp_num_hidden_layers=mtp_layers, seed=seed,
        layout="text", linear_head_dim=0,  # not the subject; GDN head dim = head_dim keeps it small
    )  # fmt: skip
    model, mtp, tok = build_tiny_model(cfg)
    with torch.no_grad():  # non-trivial zero-centred norm weights, so the "1 + w" convention matters
        gen = torch.Generator().manual_seed(seed + 7)
        for p in mtp.parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return enable_packed_attention(model), mtp


def sequences(seed: int = 0, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in lengths]


def response_masks(seqs, seed: int = 0):
    """Prompt (first ~third) carries no loss, the response does."""
    return [torch.arange(len(s)) >= len(s) // 3 for s in seqs]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_depths": 0}, "num_depths"),
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale": float("nan")}, "loss_scale"),
        ({"enabled": True, "train": False, "mtp_only": True}, "mtp_only"),
        ({"mtp_only": True}, "mtp_only"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_layers": 2}, "num_layers"),  # vLLM would never draft with layers.1
        ({"lr_scale": 0.0}, "lr_scale"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        MTPConfig(**kwargs).validate()
    assert str(err.value).startswith(field)
    assert MTPConfig().loss_scale == 0.1
    MTPConfig(enabled=True, num_depths=3).validate()


# ----------------------------------------------------------------------------- labels and masks


def reference_targets(seq, mask, depth, pad_id=0, ignore=-100):
    """One sequence, plain Python: fed token ids[t+d], label ids[t+1+d] where it carries loss."""
    n = len(seq)
    fed = [int(seq[t + depth]) if t + depth < n else pad_id for t in range(n)]
    lab = [
        int(seq[t + 1 + depth]) if t + 1 + depth < n and bool(mask[t + 1 + depth]) else ignore
        for t in range(n)
    ]
    return torch.tensor(fed), torch.tensor(lab)


@pytest.mark.parametrize("alignment, cp_size", [(1, 1), (8, 1), (8, 2), (16, 4)])
def test_packed_targets_equal_per_sequence_targets_then_packed(alignment, cp_size):
    seqs = sequences(1)
    masks = response_masks(seqs)
    batch = pack_sequences(seqs, alignment=alignment, cp_size=cp_size, pad_token_id=0)
    got = build_packed_mtp_targets(batch, num_depths=3, loss_masks=masks)
    for d in (1, 2, 3):
        ref = [reference_targets(s, m, d) for s, m in zip(seqs, masks)]
        fed = pack_per_token([r[0] for r in ref], batch, 0)
        lab = pack_per_token([r[1] for r in ref], batch, -100)
        assert torch.equal(got.labels[d - 1], lab), d
        assert torch.equal(got.mask[d - 1], lab != -100), d
        # the fed token only matters where some depth >= d is trained; there it must match
        live = lab != -100
        assert torch.equal(got.embed_ids[d - 1][live], fed[live])
    # nothing is ever taken from padding or across a boundary
    assert not got.mask[:, ~batch.valid_mask].any()
    assert got.valid_counts() == [int((got.labels[d] != -100).sum()) for d in range(3)]


def test_padded_rows_equal_packed_segments():
    seqs = sequences(2, [7, 4, 6])
    width = 8
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], valid[i, : len(s)] = s, True
    padded = build_mtp_targets(ids, 2, valid_mask=valid)
    packed = build_packed_mtp_targets(pack_sequences(seqs), 2)
    for d in range(2):
        rows = [padded.labels[d, i, : len(s)] for i, s in enumerate(seqs)]
        assert torch.equal(torch.cat(rows), packed.labels[d])


def test_context_parallel_split_uses_the_input_ids_zigzag():
    seqs = sequences(3, [8, 4])
    batch = pack_sequences(seqs, alignment=4, cp_size=2)  # segments [0,8) [8,12)
    full = build_packed_mtp_targets(batch, 2)
    # rank r keeps chunks r and 3-r of every segment (chunk = L/4), written out by hand
    by_hand = {0: [0, 1, 6, 7, 8, 11], 1: [2, 3, 4, 5, 9, 10]}
    for rank, idx in by_hand.items():
        local = split_mtp_targets_for_cp(full, batch.cu_seqlens, 2, rank)
        assert torch.equal(local.labels, full.labels[:, idx])
        assert torch.equal(local.mask, full.mask[:, idx])
        assert torch.equal(local.embed_ids, full.embed_ids[:, idx])


# ----------------------------------------------------------------------------- forward = vLLM's


def zc_rms(x, w, eps):
    """Zero-centred RMSNorm, written out: (1 + w) * x / rms(x)."""
    return (1.0 + w) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(config, positions):
    """Plain RoPE cos/sin, written out: theta_i = base^(-2i/dim) over the rotary part of the head
    (text tokens carry the same position on all three mrope axes, so mrope reduces to this)."""
    rope_params = config.rope_parameters
    head_dim = config.head_dim
    dim = int(head_dim * rope_params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (rope_params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = positions[..., None].double() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def test_mtp_rotary_is_plain_rope_at_the_shifted_positions():
    """The head hands Qwen3.5's rotary the 3-D mrope layout (transformers 5.17/5.18 reject 2-D ids);
    on text positions that is plain RoPE, and bit-identical to 2-D ids where those are accepted."""
    _, mtp = tiny()
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6]]) + 2
    x = torch.zeros(1, 7, 64)
    cos, sin = mtp.rotary_emb(x, rotary_position_ids(pos))
    ref_cos, ref_sin = rope(mtp.config, pos)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=1e-6)
    try:
        cos2, sin2 = mtp.rotary_emb(x, pos)
    except IndexError:  # transformers 5.17 / 5.18
        return
    assert torch.equal(cos, cos2) and torch.equal(sin, sin2)


# vLLM 0.32 drafts every depth with mtp.layers.0 (tests/model/test_mtp_vllm_layer.py reads this
# rule off vLLM's own module).
VLLM_DRAFT_LAYER = 0


@torch.no_grad()
def reference_drafts(model, mtp, seq, depths):
    """vLLM's drafter on one sequence alone: h = post-norm last hidden state; depth d feeds
    E[ids_{t+d}] and the previous depth's output at positions t + d - 1 through layers.0;
    logits via lm_head."""
    eps = mtp.config.rms_norm_eps
    n = len(seq)
    h = model.model(input_ids=seq[None], use_cache=False).last_hidden_state[0]
    E, W = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    out = []
    for d in range(1, depths + 1):
        fed = torch.cat([seq[d:], seq.new_zeros(min(d, n))])[:n]
        x = (
            mtp.fc.weight
            @ torch.cat(
                [
                    zc_rms(E[fed], mtp.pre_fc_norm_embedding.weight, eps),
                    zc_rms(h, mtp.pre_fc_norm_hidden.weight, eps),
                ],
                -1,
            ).T
        )
        pos = torch.arange(n)[None] + (d - 1)
        layer = mtp.layers[VLLM_DRAFT_LAYER]
        y = layer(x.T[None], position_embeddings=rope(mtp.config, pos), position_ids=pos)
        h = zc_rms(y[0] if isinstance(y, tuple) else y, mtp.norm.weight, eps)[0]
        out.append(h @ W.T)
    return out


@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_packed_forward_equals_vllm_computation_per_sequence(mtp_layers):
    model, mtp = tiny(linear_every=2, mtp_layers=mtp_layers)
    seqs = sequences(4)
    batch = pack_sequences(seqs, alignment=8)
    targets = build_packed_mtp_targets(batch, 3)
    with torch.no_grad():
        out = joint_forward(model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens)
    W = model.get_output_embeddings().weight
    for d in range(3):
        packed = unpack_per_token(mtp_logits(out.mtp_hidden[d][0], W), batch)
        for j, seq in enumerate(seqs):
            ref = reference_drafts(model, mtp, seq, 3)[d]
            torch.testing.assert_close(packed[j], ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- gradient isolation


def _grads(module):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in module.named_parameters()}


@pytest.mark.parametrize("linear_every", [0, 2], ids=["full_attn", "hybrid"])
def test_backbone_gradients_bit_identical_with_and_without_mtp_loss(linear_every):
    model, mtp = tiny(linear_every=linear_every)
    seqs = sequences(5)
    masks = response_masks(seqs)
    batch = pack_sequences(seqs, alignment=8)
    targets = build_packed_mtp_targets(batch, 2, masks)
    policy_mask = pack_per_token(masks, batch, False)

    def step(with_mtp: bool):
        model.zero_grad(set_to_none=True)
        mtp.zero_grad(set_to_none=True)
        out = joint_forward(model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens)
        from areal_npu.testing.sft import next_token_loss

        loss, _ = next_token_loss(out.logits[0], batch, policy_mask)
        (loss + out.mtp_loss if with_mtp else loss).backward()
        return _grads(model), _grads(mtp)

    base, _ = step(False)
    joint, head = step(True)
    for name, g in base.items():
        assert g is not None, name
        assert torch.equal(g, joint[name]), f"{name} gradient changed by the MTP loss"
    for name, g in head.items():
        assert g is not None and g.abs().sum() > 0, f"mtp.{name} got no gradient"


def test_mtp_loss_alone_sends_nothing_into_backbone_embedding_or_head():
    model, mtp = tiny()
    batch = pack_sequences(sequences(6), alignment=4)
    targets = build_packed_mtp_targets(batch, 2)
    out = joint_forward(model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens)
    out.mtp_loss.backward()
    assert all(p.grad is None for p in model.parameters())


def test_depth2_loss_reaches_the_depth1_block():
    model, mtp = tiny(mtp_layers=2)  # distinct blocks per depth
    batch = pack_sequences(sequences(7), alignment=4)
    targets = build_packed_mtp_targets(batch, 2)
    hidden = mtp(
        model.model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                    cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens,
                    max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen).last_hidden_state,
        targets.embed_ids[:, None], batch.position_ids[None], model.get_input_embeddings().weight,
        cu_seqlens=batch.cu_seqlens,
    )  # fmt: skip
    W = model.get_output_embeddings().weight
    depth2 = F.cross_entropy(mtp_logits(hidden[1][0], W), targets.labels[1], ignore_index=-100)
    depth2.backward()
    for name, p in mtp.named_parameters():
        if name.startswith("layers.0."):
            assert p.grad is not None and p.grad.abs().sum() > 0, f"depth-2 loss does not reach {name}"
    assert mtp.fc.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- loss


def test_loss_matches_reference_and_adds_up_over_micro_batches():
    model, mtp = tiny(seed=3)
    seqs = sequences(8)
    masks = response_masks(seqs)
    halves = [(seqs[:2], masks[:2]), (seqs[2:], masks[2:])]
    packs = [pack_sequences(s, alignment=4) for s, _ in halves]
    targets = [build_packed_mtp_targets(b, 2, m) for b, (_, m) in zip(packs, halves)]
    global_counts = [sum(t.valid_counts()[d] for t in targets) for d in range(2)]
    total, stats_sum = 0.0, {}
    for b, t in zip(packs, targets):
        with torch.no_grad():
            out = joint_forward(model, mtp, t, b.input_ids, b.position_ids, b.cu_seqlens, loss_scale=0.1,
                                num_valid_tokens=global_counts)  # fmt: skip
        total += float(out.mtp_loss)
        for k, v in out.stats.items():
            stats_sum[k] = stats_sum.get(k, 0.0) + v
    # reference: per-sequence drafts, token-mean CE per depth over all sequences, then scale / D
    ce = [[], []]
    hits = [0, 0]
    for s, m in zip(seqs, masks):
        logits = reference_drafts(model, mtp, s, 2)
        for d in range(2):
            _, lab = reference_targets(s, m, d + 1)
            keep = lab != -100
            ce[d].append(F.cross_entropy(logits[d][keep], lab[keep], reduction="none"))
            hits[d] += int((logits[d][keep].argmax(-1) == lab[keep]).sum())
    per_depth = [float(torch.cat(c).mean()) for c in ce]
    assert total == pytest.approx(0.1 / 2 * sum(per_depth), rel=1e-4)
    for d in range(2):
        assert stats_sum[f"mtp/loss_d{d + 1}"] == pytest.approx(per_depth[d], rel=1e-4)
        assert stats_sum[f"mtp/acc_d{d + 1}"] == pytest.approx(hits[d] / global_counts[d])


# ----------------------------------------------------------------------------- modes


def test_param_groups_and_weight_sync_per_mode():
    model, mtp = tiny()
    policy = {n for n, _ in model.named_parameters()}
    head = {"mtp." + n for n, _ in mtp.named_parameters()}
    joint = mtp_param_groups(model, mtp, MTPConfig(enabled=True, lr_scale=2.0))
    assert {n for n, _ in joint.policy} == policy and {n for n, _ in joint.mtp} == head
    assert [g["lr"] for g in joint.optimizer_groups(1e-3)] == [1e-3, 2e-3]
    frozen = apply_mtp_mode(model, mtp, MTPConfig(enabled=True, train=False))
    assert not frozen.mtp and not any(p.requires_grad for p in mtp.parameters())
    only = apply_mtp_mode(model, mtp, MTPConfig(enabled=True, mtp_only=True))
    assert not only.policy and not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in mtp.parameters())
    sync = weight_sync_names(model, mtp, MTPConfig(enabled=True))
    assert set(sync["policy"]) == set(model.state_dict()) and set(sync["mtp"]) == head
    assert weight_sync_names(model, mtp, MTPConfig(enabled=True, train=False))["mtp"] == []
    assert weight_sync_names(model, mtp, MTPConfig(enabled=True, mtp_only=True))["policy"] == []
    assert weight_sync_names(model, None, MTPConfig())["mtp"] == []


def test_layers_vllm_never_drafts_with_neither_train_nor_sync():
    """A 2-layer checkpoint head: vLLM drafts with layers.0 only, so layers.1 gets no gradient from
    the MTP loss at any depth and is left out of the optimizer and the weight sync."""
    model, mtp = tiny(linear_every=0, mtp_layers=2)
    unused = {"mtp." + n for n, _ in mtp.layers[1].named_parameters(prefix="layers.1")}
    groups = apply_mtp_mode(model, mtp, MTPConfig(enabled=True, num_depths=3))
    names = {n for n, _ in groups.mtp}
    assert unused and not names & unused
    assert names | unused == {"mtp." + n for n, _ in mtp.named_parameters()}
    assert not set(weight_sync_names(model, mtp, MTPConfig(enabled=True))["mtp"]) & unused
    mtp.layers[1].requires_grad_(True)  # so a stray use of layers.1 would show up as a gradient
    batch = pack_sequences(sequences(3), alignment=4)
    targets = build_packed_mtp_targets(batch, 3)
    out = joint_forward(model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens)
    out.mtp_loss.backward()
    assert all(p.grad is None for p in mtp.layers[1].parameters())
    assert all(p.grad is not None for p in mtp.layers[0].parameters())


def test_attaches_to_a_qwen3_model_with_isolation():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from areal_npu.model.mtp_checkpoint import attach_mtp

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )  # fmt: skip
    )
    enable_packed_attention(model)
    mtp = attach_mtp(model, MTPConfig(enabled=True, init_new_head=True))
    seqs = [torch.randint(0, 97, (n,)) for n in (9, 4, 6)]
    batch = pack_sequences(seqs)
    out = joint_forward(model, mtp, build_packed_mtp_targets(batch, 2), batch.input_ids, batch.position_ids,
                        batch.cu_seqlens)  # fmt: skip
    out.mtp_loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in mtp.parameters())
    # the same head on each sequence alone
    with torch.no_grad():
        alone = mtp(model.model(input_ids=seqs[1][None]).last_hidden_state,
                    build_mtp_targets(seqs[1], 1).embed_ids[:, None], torch.arange(4)[None],
                    model.get_input_embeddings().weight)[0][0]  # fmt: skip
    torch.testing.assert_close(out.mtp_hidden[0][0, 9:13].detach(), alone, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- checkpoints


def test_round_trip_save_load_identical_logits(tmp_path):
    from areal_npu.model.layout import load_model_with_mtp, save_model_with_mtp

    model, mtp = tiny(linear_every=0)
    save_model_with_mtp(model, mtp, tmp_path / "ckpt")
    loaded, head = load_model_with_mtp(tmp_path / "ckpt", MTPConfig(enabled=True))
    enable_packed_attention(loaded)
    batch = pack_sequences(sequences(9), alignment=4)
    targets = build_packed_mtp_targets(batch, 2)
    with torch.no_grad():
        a = joint_forward(model, mtp, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens)
        b = joint_forward(loaded, head, targets, batch.input_ids, batch.position_ids, batch.cu_seqlens)
    assert torch.equal(a.logits, b.logits)
    W1, W2 = model.get_output_embeddings().weight, loaded.get_output_embeddings().weight
    for x, y in zip(a.mtp_hidden, b.mtp_hidden):
        assert torch.equal(mtp_logits(x, W1), mtp_logits(y, W2))
    assert loaded.config.mtp_num_hidden_layers == 1


def test_missing_head_fails_clearly_unless_init_new_head(tmp_path):
    from areal_npu.model.layout import load_model_with_mtp, save_model_with_mtp

    model, _ = tiny(linear_every=0)
    save_model_with_mtp(model, None, tmp_path / "nohead")
    with pytest.raises(ValueError, match=r"no mtp\.\* weights.*init_new_head"):
        load_model_with_mtp(tmp_path / "nohead", MTPConfig(enabled=True))
    _, head = load_model_with_mtp(tmp_path / "nohead", MTPConfig(enabled=True, init_new_head=True))
    assert isinstance(head, Qwen35MTP)
    assert load_model_with_mtp(tmp_path / "nohead", MTPConfig(enabled=False))[1] is None


def test_shape_mismatch_names_the_tensor(tmp_path):
    from areal_npu.model.mtp import mtp_state_dict
    from areal_npu.model.mtp_checkpoint import load_mtp_state

    _, mtp = tiny()
    state = mtp_state_dict(mtp)
    state["mtp.fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"mtp\.fc\.weight.*\(3, 3\).*\(64, 128\)"):
        load_mtp_state(mtp, state)
    del state["mtp.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['mtp\.norm\.weight'\]"):
        load_mtp_state(mtp, state)


def test_new_head_init_is_identity_norms():
    _, mtp = tiny()
    init_mtp_weights(mtp, std=0.02)
    assert all(float(p.detach().abs().max()) == 0.0 for p in mtp.parameters() if p.dim() == 1)


def test_mtp_loss_rejects_wrong_shapes():
    _, mtp = tiny()
    targets = build_mtp_targets(torch.arange(6), 1)
    with pytest.raises(ValueError, match="mtp_hidden"):
        mtp_loss([torch.zeros(5, 64)], torch.zeros(320, 64), targets)


# ----------------------------------------------------------------------------- warm start / modes in training


def _warm(mode_cfg, steps=3):
    from areal_npu.testing.sft import sft_warm_start

    model, mtp = tiny(linear_every=2)
    seqs = sequences(10, [12, 7, 9, 5])
    batches = [[(s, m) for s, m in zip(seqs[:2], response_masks(seqs[:2]))], seqs[2:]]
    history = sft_warm_start(model, mtp, batches, steps, mode_cfg, lr=1e-2, log_every=1)
    return model, mtp, history


def test_joint_training_updates_the_policy_exactly_like_sft_alone():
    sft_model, sft_head, _ = _warm(MTPConfig(enabled=False))
    joint_model, joint_head, history = _warm(MTPConfig(enabled=True, num_depths=2))
    for (name, a), b in zip(sft_model.state_dict().items(), joint_model.state_dict().values()):
        assert torch.equal(a, b), f"{name}: the MTP loss changed the policy update"
    assert any(not torch.equal(a, b) for a, b in zip(sft_head.parameters(), joint_head.parameters()))
    assert {N.mtp_loss_key(1), N.mtp_acc_key(1), N.mtp_loss_key(2), N.mtp_acc_key(2), N.SFT_LOSS} <= set(history[-1])


def test_mtp_only_trains_the_head_on_a_frozen_base():
    fresh_model, fresh_head = tiny(linear_every=2)
    model, mtp, history = _warm(MTPConfig(enabled=True, mtp_only=True))
    for (name, a), b in zip(fresh_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{name} changed in MTP-only training"
    assert all(not torch.equal(a, b) for a, b in zip(fresh_head.parameters(), mtp.parameters()))
    assert N.SFT_LOSS not in history[-1]


def test_frozen_head_is_left_alone():
    _, fresh_head = tiny(linear_every=2)
    _, mtp, _ = _warm(MTPConfig(enabled=True, train=False))
    assert all(torch.equal(a, b) for a, b in zip(fresh_head.parameters(), mtp.parameters()))


def test_position_ids_alone_mark_the_segments_at_every_depth():
    model, mtp = tiny()
    batch = pack_sequences(sequences(11), alignment=4)
    targets = build_packed_mtp_targets(batch, 3)
    with torch.no_grad():
        h = model.model(
            input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]
        ).last_hidden_state
        args = (h, targets.embed_ids[:, None], batch.position_ids[None], model.get_input_embeddings().weight)
        with_cu = mtp(*args, cu_seqlens=batch.cu_seqlens)
        without = mtp(*args)
    for a, b in zip(with_cu, without):
        assert torch.equal(a, b)


def test_right_padded_batch_gives_the_packed_loss():
    model, mtp = tiny(linear_every=0)
    seqs = sequences(12, [9, 5, 7])
    ids = torch.zeros(3, 9, dtype=torch.long)
    valid = torch.zeros(3, 9, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], valid[i, : len(s)] = s, True
    pos = torch.arange(9).expand(3, 9)
    batch = pack_sequences(seqs)
    with torch.no_grad():
        padded = joint_forward(model, mtp, build_mtp_targets(ids, 2, valid_mask=valid), ids, pos)
        packed = joint_forward(
            model,
            mtp,
            build_packed_mtp_targets(batch, 2),
            batch.input_ids,
            batch.position_ids,
            batch.cu_seqlens,
        )
    torch.testing.assert_close(padded.mtp_loss, packed.mtp_loss, rtol=1e-5, atol=1e-6)
    assert padded.stats[N.mtp_count_key(2)] == packed.stats[N.mtp_count_key(2)]
