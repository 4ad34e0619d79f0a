"""Decoupled PPO loss against an independent per-token loop implementation."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu import names
from areal_npu.algo.ppo import PPOConfig, decoupled_ppo_loss, ppo_clip_token_loss

# ---------------------------------------------------------------- naive reference (loops, scalars)


def naive_loss(logp, prox, behave, adv, mask, seg, cfg, ref=None, denom=None):
    """Loop over tokens with 0-d tensors; behave weight as python floats (constants)."""
    T = logp.shape[0]
    lo = cfg.eps_clip_low
    hi = cfg.eps_clip_low if cfg.eps_clip_high is None else cfg.eps_clip_high
    valid = [t for t in range(T) if bool(mask[t])]
    seqs = sorted({int(seg[t]) for t in valid})
    # sequence geometric means of the behaviour ratio over valid tokens
    geo = {}
    for s in seqs:
        toks = [t for t in valid if int(seg[t]) == s]
        geo[s] = math.exp(sum(float(prox[t]) - float(behave[t]) for t in toks) / len(toks))
    contrib = {}
    for t in valid:
        anchor = prox[t] if cfg.decoupled else behave[t]
        r = torch.exp(logp[t] - anchor)
        a = float(adv[t])
        l1 = -a * r
        l2 = -a * torch.clamp(r, 1 - lo, 1 + hi)
        loss_t = torch.maximum(l1, l2)
        if cfg.dual_clip is not None and a < 0 and float(loss_t.detach()) > -cfg.dual_clip * a:
            loss_t = torch.zeros_like(loss_t) + (-cfg.dual_clip * a)
        keep = True
        if cfg.decoupled:
            w = math.exp(float(prox[t]) - float(behave[t]))
            cap = cfg.behave_imp_weight_cap
            if cfg.behave_imp_weight_mode == "clamp":
                if cfg.behave_imp_weight_level == "token":
                    w = min(w, cap)
                else:
                    w = w * min(1.0, cap / geo[int(seg[t])])
            elif cfg.behave_imp_weight_mode == "mask":
                g = w if cfg.behave_imp_weight_level == "token" else geo[int(seg[t])]
                keep = g <= cap
            loss_t = w * loss_t
        if cfg.kl_coef > 0:
            d = ref[t] - logp[t]
            k = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[cfg.kl_estimator]
            loss_t = loss_t + cfg.kl_coef * k
        contrib[t] = loss_t if keep else 0.0 * loss_t
    total = logp.sum() * 0.0
    if cfg.loss_agg == "token-mean":
        for t in valid:
            total = total + contrib[t]
        return total / (max(len(valid), 1) if denom is None else denom)  # empty batch → 0
    for s in seqs:
        toks = [t for t in valid if int(seg[t]) == s]
        seq_sum = logp.sum() * 0.0
        for t in toks:
            seq_sum = seq_sum + contrib[t]
        total = total + seq_sum / len(toks)
    return total / (max(len(seqs), 1) if denom is None else denom)


# ---------------------------------------------------------------- random packed batches


def make_batch(seed, lengths, noise=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = torch.rand(T, generator=g) > 0.25
    behave = -torch.rand(T, generator=g, dtype=dtype) * 2 - 0.05
    prox = behave + noise * torch.randn(T, generator=g, dtype=dtype)
    logp = prox + noise * torch.randn(T, generator=g, dtype=dtype)
    ref = logp + 0.2 * torch.randn(T, generator=g, dtype=dtype)
    seq_adv = torch.randn(len(lengths), generator=g, dtype=dtype)
    adv = seq_adv[seg]
    return dict(logp=logp, prox=prox, behave=behave, ref=ref, adv=adv, mask=mask, seg=seg, cu=cu)


def run_ours(b, cfg, denom=None, logp=None):
    logp = b["logp"].clone().requires_grad_() if logp is None else logp
    loss, stats = decoupled_ppo_loss(
        logp,
        b["adv"],
        b["mask"],
        logp_behave=b["behave"],
        logp_prox=b["prox"],
        config=cfg,
        global_denominator=denom,
        cu_seqlens=b["cu"],
        logp_ref=b["ref"],
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, stats


def run_naive(b, cfg, denom=None):
    logp = b["logp"].clone().requires_grad_()
    loss = naive_loss(logp, b["prox"], b["behave"], b["adv"], b["mask"], b["seg"], cfg, b["ref"], denom)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return loss, torch.zeros_like(logp) if grad is None else grad


configs = st.builds(
    PPOConfig,
    eps_clip_low=st.sampled_from([0.1, 0.2]),
    eps_clip_high=st.sampled_from([None, 0.28]),
    dual_clip=st.sampled_from([None, 3.0, 1.5]),
    decoupled=st.booleans(),
    loss_agg=st.sampled_from(["token-mean", "seq-mean"]),
    kl_coef=st.sampled_from([0.0, 0.05]),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
).flatmap(
    lambda c: st.sampled_from(
        [("none", None, "token")]
        + (
            [(m, cap, lvl) for m in ("clamp", "mask") for lvl in ("token", "sequence") for cap in (1.0, 1.2)]
            if c.decoupled
            else []
        )
    ).map(
        lambda mcl: dataclasses.replace(
            c, behave_imp_weight_mode=mcl[0], behave_imp_weight_cap=mcl[1], behave_imp_weight_level=mcl[2]
        )
    )
)


@settings(max_examples=80, deadline=None)
@given(
    cfg=configs,
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    noise=st.sampled_from([0.05, 0.3, 0.8]),
)
def test_loss_and_grad_match_naive(cfg, seed, lengths, noise):
    cfg.validate()
    b = make_batch(seed, lengths, noise)
    loss, grad, _ = run_ours(b, cfg)
    ref_loss, ref_grad = run_naive(b, cfg)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_config_grid_actually_clips_and_masks():
    """The random batches exercise the branches the naive comparison is meant to cover."""
    b = make_batch(3, [9] * 8, noise=0.8)
    cfg = PPOConfig(dual_clip=1.5, behave_imp_weight_mode="mask", behave_imp_weight_cap=1.2)
    _, _, stats = run_ours(b, cfg)
    assert float(stats[names.PPO_CLIP_RATIO]) > 0
    assert float(stats[names.PPO_DUAL_CLIP_RATIO]) > 0
    assert 0 < float(stats[names.BEHAVE_IMP_WEIGHT_OUTLIER_RATIO]) < 1


def test_decoupled_equals_standard_when_prox_is_behave():
    b = make_batch(11, [5, 7, 3])
    b["prox"] = b["behave"].clone()
    for agg in ("token-mean", "seq-mean"):
        dec = PPOConfig(decoupled=True, eps_clip_high=0.28, dual_clip=3.0, loss_agg=agg)
        std = dataclasses.replace(dec, decoupled=False)
        l1, g1, _ = run_ours(b, dec)
        l2, g2, _ = run_ours(b, std)
        torch.testing.assert_close(l1, l2)
        torch.testing.assert_close(g1, g2)


def test_behave_imp_weight_is_detached_and_always_applied():
    b = make_batch(5, [6, 6, 6])
    cfg = PPOConfig(decoupled=True)
    prox = b["prox"].clone().requires_grad_()
    behave = b["behave"].clone().requires_grad_()
    logp = b["logp"].clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(
        logp, b["adv"], b["mask"], logp_behave=behave, logp_prox=prox, config=cfg, cu_seqlens=b["cu"]
    )
    g_logp, g_prox, g_behave = torch.autograd.grad(loss, (logp, prox, behave), allow_unused=True)
    # behave only enters through the weight: no gradient at all
    assert g_behave is None or torch.equal(g_behave, torch.zeros_like(g_behave))
    # prox gets gradient only through the clip ratio π_θ/π_prox, i.e. exactly −∂/∂logp
    torch.testing.assert_close(g_prox, -g_logp)
    # the weight is applied: differs from the unweighted loss (weights are far from 1 here)
    unweighted = naive_loss(logp, prox.detach(), prox.detach(), b["adv"], b["mask"], b["seg"], cfg)
    assert not torch.allclose(loss, unweighted)
    weighted = naive_loss(logp, prox.detach(), behave.detach(), b["adv"], b["mask"], b["seg"], cfg)
    torch.testing.assert_close(loss, weighted)


def test_decoupled_requires_prox():
    b = make_batch(1, [4])
    with pytest.raises(ValueError, match="logp_prox"):
        decoupled_ppo_loss(b["logp"], b["adv"], b["mask"], logp_behave=b["behave"], config=PPOConfig())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("imp", [("none", None, "token"), ("mask", 1.1, "sequence"), ("clamp", 1.1, "token")])
def test_micro_batches_sum_to_the_global_batch(agg, imp):
    lengths = [5, 3, 8, 2, 6, 4]
    b = make_batch(21, lengths, noise=0.4)
    cfg = PPOConfig(
        dual_clip=3.0,
        eps_clip_high=0.28,
        loss_agg=agg,
        kl_coef=0.1,
        behave_imp_weight_mode=imp[0],
        behave_imp_weight_cap=imp[1],
        behave_imp_weight_level=imp[2],
    ).validate()
    mask, seg = b["mask"], b["seg"]
    if agg == "token-mean":
        denom = int(mask.sum())
    else:
        denom = len({int(s) for s in seg[mask]})
    logp = b["logp"].clone().requires_grad_()
    full, _ = decoupled_ppo_loss(
        logp, b["adv"], mask, logp_behave=b["behave"], logp_prox=b["prox"], config=cfg,
        global_denominator=denom, cu_seqlens=b["cu"], logp_ref=b["ref"],
    )  # fmt: skip
    (g_full,) = torch.autograd.grad(full, logp)
    # three micro-batches at sequence boundaries, each with its own cu_seqlens
    total = 0.0
    logp2 = b["logp"].clone().requires_grad_()
    cu = b["cu"].tolist()
    for lo, hi in [(0, 2), (2, 3), (3, 6)]:
        s, e = cu[lo], cu[hi]
        mb_cu = torch.tensor(cu[lo : hi + 1]) - s
        mb_loss, _ = decoupled_ppo_loss(
            logp2[s:e], b["adv"][s:e], mask[s:e], logp_behave=b["behave"][s:e], logp_prox=b["prox"][s:e],
            config=cfg, global_denominator=denom, cu_seqlens=mb_cu, logp_ref=b["ref"][s:e],
        )  # fmt: skip
        total = total + mb_loss
    (g_mb,) = torch.autograd.grad(total, logp2)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_mb, g_full)


def test_dual_clip_hand_worked():
    # A = −1, r = 5, ε = .2, c = 3: max(5, 1.2) = 5 → dual bound min(5, 3) = 3, zero gradient
    logp = torch.tensor([math.log(5.0)], requires_grad=True)
    out = ppo_clip_token_loss(
        logp, torch.zeros(1), torch.tensor([-1.0]), eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=3.0
    )
    assert out.loss.item() == pytest.approx(3.0)
    assert bool(out.dual_clipped) and not bool(out.clipped)
    (g,) = torch.autograd.grad(out.loss.sum(), logp)
    assert float(g) == 0.0
    # without dual clip the loss is −A·r = 5 and gradient −A·r = 5
    out2 = ppo_clip_token_loss(
        logp, torch.zeros(1), torch.tensor([-1.0]), eps_clip_low=0.2, eps_clip_high=0.2
    )
    assert out2.loss.item() == pytest.approx(5.0)


def test_clip_higher_hand_worked():
    # A = 1, r = 1.25: clipped at 1.2 with symmetric ε = .2, not clipped with ε_high = .28
    logp = torch.tensor([math.log(1.25)])
    sym = ppo_clip_token_loss(logp, torch.zeros(1), torch.ones(1), eps_clip_low=0.2, eps_clip_high=0.2)
    hi = ppo_clip_token_loss(logp, torch.zeros(1), torch.ones(1), eps_clip_low=0.2, eps_clip_high=0.28)
    assert float(sym.loss) == pytest.approx(-1.2) and bool(sym.clipped)
    assert float(hi.loss) == pytest.approx(-1.25) and not bool(hi.clipped)
    # lower side: A = −1, r = .7 → max(.7, .8) = .8, clipped
    lo = ppo_clip_token_loss(
        torch.tensor([math.log(0.7)]), torch.zeros(1), -torch.ones(1), eps_clip_low=0.2, eps_clip_high=0.28
    )
    assert float(lo.loss) == pytest.approx(0.8) and bool(lo.clipped)


def test_stats_match_naive_and_ignore_masked_positions():
    b = make_batch(9, [4, 5, 6])
    mask = b["mask"]
    T = mask.numel()
    versions = torch.randint(0, 4, (T,), generator=torch.Generator().manual_seed(0))
    entropy = torch.rand(T, dtype=torch.float64)
    # garbage at masked positions must not reach the loss, its gradient or the stats
    poison = lambda x: torch.where(mask, x, torch.full_like(x, float("nan")))  # noqa: E731
    logp = poison(b["logp"]).requires_grad_()
    cfg = PPOConfig(eps_clip_low=0.1, dual_clip=2.0, kl_coef=0.1)
    loss, stats = decoupled_ppo_loss(
        logp, poison(b["adv"]), mask, logp_behave=poison(b["behave"]), logp_prox=poison(b["prox"]),
        config=cfg, cu_seqlens=b["cu"], logp_ref=poison(b["ref"]), entropy=poison(entropy),
        versions=torch.where(mask, versions, 10**6), policy_version=5,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.equal(g[~mask], torch.zeros_like(g[~mask]))
    assert all(torch.isfinite(v) for v in stats.values())

    v = [t for t in range(T) if bool(mask[t])]
    w = [math.exp(float(b["prox"][t] - b["behave"][t])) for t in v]
    r = [math.exp(float(b["logp"][t] - b["prox"][t])) for t in v]
    a = [float(b["adv"][t]) for t in v]
    clipped = dual = 0
    for ri, ai in zip(r, a, strict=True):
        unc, clp = -ai * ri, -ai * min(max(ri, 0.9), 1.1)
        lt = max(unc, clp)
        if ai < 0 and lt > -2.0 * ai:
            dual += 1
        elif clp > unc:
            clipped += 1
    expect = {
        names.BEHAVE_IMP_WEIGHT_MEAN: sum(w) / len(v),
        "ppo/behave_imp_weight/min": min(w),
        "ppo/behave_imp_weight/max": max(w),
        names.BEHAVE_APPROX_KL: sum(float(b["behave"][t] - b["prox"][t]) for t in v) / len(v),
        names.PPO_IMPORTANCE_WEIGHT: sum(r) / len(v),
        names.PPO_CLIP_RATIO: clipped / len(v),
        names.PPO_DUAL_CLIP_RATIO: dual / len(v),
        names.PPO_APPROX_KL: sum(float(b["prox"][t] - b["logp"][t]) for t in v) / len(v),
        names.PPO_ENTROPY: sum(float(entropy[t]) for t in v) / len(v),
        names.VERSION_LAG_MEAN: sum(5 - int(versions[t]) for t in v) / len(v),
        names.VERSION_LAG_MAX: max(5 - int(versions[t]) for t in v),
        names.PPO_N_VALID_TOKENS: len(v),
    }
    for key, val in expect.items():
        assert float(stats[key]) == pytest.approx(val, rel=1e-6, abs=1e-9), key
    assert float(stats[names.PPO_LOSS]) == pytest.approx(loss.item())


@pytest.mark.parametrize(
    "key,value",
    [
        ("eps_clip_low", 0.0),
        ("eps_clip_low", 1.0),
        ("eps_clip_high", -0.1),
        ("dual_clip", 1.0),
        ("dual_clip", 0.5),
        ("behave_imp_weight_mode", "truncate"),
        ("behave_imp_weight_level", "batch"),
        ("behave_imp_weight_cap", 2.0),  # cap without a mode is a silent no-op: rejected
        ("loss_agg", "seq-sum"),
        ("kl_coef", -1.0),
        ("kl_estimator", "k5"),
        ("on_nonfinite", "ignore"),
    ],
)
def test_config_validate_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"PPOConfig.{key}"):
        dataclasses.replace(PPOConfig(), **{key: value}).validate()


def test_config_validate_cap_required_with_mode():
    with pytest.raises(ValueError, match="behave_imp_weight_cap"):
        PPOConfig(behave_imp_weight_mode="mask").validate()
    with pytest.raises(ValueError, match="behave_imp_weight_cap"):
        PPOConfig(behave_imp_weight_mode="clamp", behave_imp_weight_cap=0.5).validate()
    with pytest.raises(ValueError, match="decoupled"):
        PPOConfig(decoupled=False, behave_imp_weight_mode="clamp", behave_imp_weight_cap=2.0).validate()
    PPOConfig(behave_imp_weight_mode="clamp", behave_imp_weight_cap=2.0).validate()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_padded_layout_equals_packed(agg):
    lengths = [4, 7, 2]
    b = make_batch(17, lengths, noise=0.5)
    cfg = PPOConfig(
        loss_agg=agg,
        behave_imp_weight_mode="clamp",
        behave_imp_weight_cap=1.1,
        behave_imp_weight_level="sequence",
    )
    packed, _, _ = run_ours(b, cfg)
    B, L = len(lengths), max(lengths)

    def pad(x, fill=0):
        out = torch.full((B, L), fill, dtype=x.dtype)
        for i, (s, e) in enumerate(zip(b["cu"][:-1].tolist(), b["cu"][1:].tolist(), strict=True)):
            out[i, : e - s] = x[s:e]
        return out

    seg = torch.arange(B)[:, None].expand(B, L)
    padded, _ = decoupled_ppo_loss(
        pad(b["logp"]), pad(b["adv"]), pad(b["mask"], False), logp_behave=pad(b["behave"]),
        logp_prox=pad(b["prox"]), config=cfg, segment_ids=seg, logp_ref=pad(b["ref"]),
    )  # fmt: skip
    torch.testing.assert_close(padded, packed.detach())
