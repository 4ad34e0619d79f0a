"""The EAGLE-3 drafter in the FSDP2 trainer: isolation from the policy, learning, export, config.

References: the policy's gradients of the same step without a drafter (bit for bit); transformers'
own ``output_hidden_states`` for the auxiliary residual stream; vLLM's checkpoint names
(``vllm/model_executor/models/llama_eagle3.py``). That vLLM loads and drafts with the checkpoint:
``tests/rollout/test_eagle3_engine.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from areal_npu import names
from areal_npu.config import ConfigError
from areal_npu.data.packing import PackingConfig
from areal_npu.model.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    capture_aux_states,
    default_aux_layers,
    load_eagle3_drafter,
    save_eagle3_drafter,
)
from areal_npu.model.tiny import build_tiny_model
from areal_npu.rollout.weight_stream import iter_target_buckets
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import PPOLoss, SFTLoss
from areal_npu.train.optim import OptimConfig
from tests.train.test_engine import TINY, make_samples

#: the names vLLM's Eagle3LlamaForCausalLM.load_weights maps (``midlayer.`` -> ``layers.0.``)
VLLM_NAMES = {
    "fc.weight", "norm.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def _engine(drafter: bool, depths: int = 2, lr: float = 1e-2, cap: int = 24):
    lm, _, _ = build_tiny_model(TINY)
    cfg = TrainEngineConfig(
        packing=PackingConfig(max_tokens_per_mb=cap), optim=OptimConfig(lr=lr, grad_clip=1.0)
    )
    e3cfg = Eagle3Config(enabled=True, num_depths=depths)
    head = Eagle3Drafter.for_policy(lm.config, e3cfg, torch.Generator().manual_seed(0)) if drafter else None
    return FSDPEngine(lm, None, cfg, eagle3=head, eagle3_config=e3cfg if drafter else None)


def test_policy_gradients_are_bit_identical_with_and_without_the_drafter_loss():
    samples = make_samples()
    loss = PPOLoss()
    plain, joint = _engine(False), _engine(True)
    for s, lp in zip(samples, plain.compute_logprobs(samples), strict=True):
        s.prox_logp = lp
    stats_plain = plain.forward_backward(copy.deepcopy(samples), loss)
    stats_joint = joint.forward_backward(copy.deepcopy(samples), loss)
    grads = {n: p.grad for n, p in joint.lm.named_parameters()}
    for name, p in plain.lm.named_parameters():
        assert torch.equal(p.grad.full_tensor(), grads[name].full_tensor()), name
    drafted = [p.grad for p in joint.eagle3.parameters()]
    assert all(g is not None for g in drafted) and any(
        float(g.full_tensor().abs().sum()) > 0 for g in drafted
    )
    assert stats_plain[names.PPO_LOSS] == stats_joint[names.PPO_LOSS]
    keys = names.as_eagle3_stats({names.MTP_LOSS: 0, names.mtp_acc_key(1): 0, names.mtp_loss_key(2): 0})
    assert set(keys) <= set(stats_joint) and not any(k.startswith(names.MTP_STATS) for k in stats_joint)
    # and the step: policy weights after it equal the step without a drafter
    plain.optimizer_step()
    joint.optimizer_step()
    after = dict(joint.lm.named_parameters())
    for name, p in plain.lm.named_parameters():
        assert torch.equal(p.full_tensor(), after[name].full_tensor()), name


def test_the_drafter_loss_decreases_on_a_fixed_batch():
    engine = _engine(True, depths=1, lr=5e-2, cap=64)
    samples = make_samples(3, seed=5)
    key = names.as_eagle3_stats({names.MTP_LOSS: 0}).popitem()[0]
    losses = []
    for _ in range(10):
        losses.append(engine.forward_backward(copy.deepcopy(samples), SFTLoss())[key])
        engine.optimizer_step()
    assert losses[-1] < 0.5 * losses[0], losses


def test_aux_states_are_the_residual_stream_transformers_reports():
    lm, _, _ = build_tiny_model(TINY)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), capture_aux_states(lm.model, [0, 1]) as aux:
        out = lm.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    for i in (0, 1):  # hidden_states[i]: after i layers (the last entry is post final norm: not comparable)
        assert torch.equal(aux[i], out.hidden_states[i])


def test_export_names_and_checkpoint_are_what_vllm_loads(tmp_path):
    engine = _engine(True)
    exported = [(k, n) for k, bucket in engine.export_buckets() for n, _ in bucket]  # the engines' drafter
    drafter = {n for k, n in exported if k == "eagle3"}
    assert drafter == {names.EAGLE3_PREFIX + n for n in VLLM_NAMES}
    assert {n for k, n in exported if k == "policy"} == {n for n, _ in engine.full_state_dict()}
    stream = [(n, torch.zeros(1)) for _, n in exported]
    sent = {t: [n for n, _ in b] for t, b in iter_target_buckets(stream, 1 << 20)}
    assert set(sent["draft"]) == VLLM_NAMES
    assert not any(n.startswith(names.EAGLE3_PREFIX) for n in sent["policy"])
    assert "draft" not in dict(iter_target_buckets(stream, 1 << 20, sync_draft=False))

    head = Eagle3Drafter.for_policy(
        engine.lm.config, Eagle3Config(enabled=True), torch.Generator().manual_seed(2)
    )
    path = save_eagle3_drafter(head, tmp_path / "drafter")
    again = load_eagle3_drafter(path)
    assert {n for n, _ in again.named_parameters()} == VLLM_NAMES
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), again.parameters(), strict=True))
    assert again.config["architectures"] == ["LlamaForCausalLMEagle3"]
    layers = again.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layers == default_aux_layers(TINY.num_hidden_layers) == [0, 1, 2]
    assert again.fc.weight.shape == (TINY.hidden_size, 3 * TINY.hidden_size)
    assert again.midlayer.self_attn.q_proj.weight.shape[1] == 2 * TINY.hidden_size


def test_default_aux_layers_follow_vllm_and_stay_distinct():
    assert default_aux_layers(64) == [2, 32, 61]  # vLLM's (2, n // 2, n - 3)
    assert default_aux_layers(4) == [0, 2, 4]  # vLLM's would be (2, 2, 1): two ids after its dedup


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        (dict(enabled=True, aux_layers=[2, 1, 3]), "aux_layers"),
        (dict(enabled=True, num_depths=0), "num_depths"),
        (dict(enabled=True, loss_scale=-1.0), "loss_scale"),
        (dict(enabled=True, init_dir="/nonexistent"), "init_dir"),
        (dict(num_depths=2), "num_depths"),  # read only when enabled
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        Eagle3Config(**kwargs).validate()
    assert err.value.key == key


def test_the_second_draft_step_attends_like_vllms_proposer():
    """Reference: vLLM's decoding order written out with an explicit KV cache -- one depth-1 pass
    over the verified tokens fills the cache (keys at positions 0..t), then the depth-2 query of
    index t (position t + 1) attends to that prefix and to its own new key, one t at a time."""
    import torch.nn.functional as F

    from areal_npu.model.eagle3 import _rope

    torch.manual_seed(0)
    lm, _, _ = build_tiny_model(TINY)
    drafter = Eagle3Drafter.for_policy(
        lm.config, Eagle3Config(enabled=True), torch.Generator().manual_seed(4)
    )
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(5))
    n, embed = len(ids), lm.get_input_embeddings().weight
    with torch.no_grad(), capture_aux_states(lm.model, drafter.aux_layers) as aux:
        lm.model(input_ids=ids[None], use_cache=False)
    states = [aux[i][0] for i in drafter.aux_layers]
    nxt = torch.cat([ids[1:], ids[:1]])  # ids_{t+1} (the last one predicts nothing)
    with torch.no_grad():
        got = drafter(states, torch.stack([nxt, torch.cat([ids[2:], ids[:2]])]), torch.arange(n), embed,
                      torch.tensor([0, n]))[1]  # fmt: skip
        layer, attn = drafter.midlayer, drafter.midlayer.self_attn
        rep = attn.heads // attn.kv_heads

        def kv_q(hidden, token_ids, positions):
            x = torch.cat(
                [layer.input_layernorm(F.embedding(token_ids, embed)), layer.hidden_norm(hidden)], -1
            )
            shape = (len(token_ids), -1, attn.head_dim)
            q = _rope(attn.q_proj(x).view(shape), positions, attn.theta)
            return q, _rope(attn.k_proj(x).view(shape), positions, attn.theta), attn.v_proj(x).view(shape)

        def finish(hidden, q, k, v, mask):
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask,
            ).transpose(0, 1)  # fmt: skip
            s = hidden + attn.o_proj(o.reshape(len(hidden), -1))
            r = s + layer.mlp(layer.post_attention_layernorm(s))
            return drafter.norm(r), r

        g1 = drafter.fc(torch.cat(states, -1))
        q1, k1, v1 = kv_q(g1, nxt, torch.arange(n))
        _, r1 = finish(g1, q1, k1, v1, torch.ones(n, n, dtype=torch.bool).tril())
        for t in range(n - 2):
            q2, k2, v2 = kv_q(r1[t : t + 1], ids[t + 2 : t + 3], torch.tensor([t + 1]))
            want, _ = finish(
                r1[t : t + 1], q2, torch.cat([k1[: t + 1], k2]), torch.cat([v1[: t + 1], v2]), None
            )  # fmt: skip
            torch.testing.assert_close(got[t], want[0], rtol=1e-5, atol=1e-5)


def test_a_trainer_built_from_a_checkpoint_keeps_the_drafter_it_was_given(tmp_path):
    """``areal-npu train`` builds the policy on the meta device and reads its rows from the
    checkpoint (``FSDPEngine.from_checkpoint``); the drafter (``initial_drafter``) comes in whole."""
    from areal_npu.model.eagle3 import initial_drafter
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "policy", TinyModelConfig(**TEXT_FULL_ATTENTION))
    cfg = Eagle3Config(enabled=True)
    drafter = initial_drafter(model_dir, cfg, seed=3)
    given = {names.EAGLE3_PREFIX + n: p.detach().clone() for n, p in drafter.named_parameters()}
    engine = FSDPEngine.from_checkpoint(
        model_dir, TrainEngineConfig(), MTPConfig(), eagle3=drafter, eagle3_config=cfg
    )
    held = dict(engine.eagle3_state_dict())
    assert held.keys() == given.keys() and all(torch.equal(held[n], given[n]) for n in given)


def test_with_an_eagle3_drafter_the_mtp_head_trains_but_is_not_sent():
    """The engines draft with EAGLE-3: ``mtp.*`` would reach vLLM's EAGLE-3 module and fail the sync
    (``There is no module or parameter named 'mtp' in LlamaModel``, seen in an ``areal-npu train``)."""
    from areal_npu.model.mtp import MTPConfig

    lm, head, _ = build_tiny_model(TINY)
    e3cfg = Eagle3Config(enabled=True)
    drafter = Eagle3Drafter.for_policy(lm.config, e3cfg, torch.Generator().manual_seed(0))
    engine = FSDPEngine(
        lm, head, TrainEngineConfig(), MTPConfig(enabled=True), eagle3=drafter, eagle3_config=e3cfg
    )
    stats = engine.forward_backward(make_samples(2), SFTLoss())
    assert names.MTP_LOSS in stats and names.as_eagle3_stats({names.MTP_LOSS: 0}).popitem()[0] in stats
    kinds = {k for k, _ in engine.export_buckets()}
    assert kinds == {"policy", "eagle3"}
