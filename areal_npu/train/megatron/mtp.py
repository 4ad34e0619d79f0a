"""The MTP head in the Megatron engine: Megatron-Core's ``MultiTokenPredictionLayer`` computing our
head's math (:mod:`areal_npu.model.mtp`), under the checkpoint's ``mtp.*`` names.

Our head at depth 1 (what vLLM's Qwen3.5/3.6 drafter computes), ``h`` the decoder's final-norm
hidden state, ``E`` / ``W`` the shared embedding / output head:

    h1_t = norm(layer(fc([enorm(E[ids_{t+1}]) ; hnorm(h_t)]), rope at pos_t)),  logits = W h1_t

Megatron-Core 0.16.1's ``MultiTokenPredictionLayer`` has the same blocks (``enorm``, ``hnorm``,
``eh_proj`` over ``[embedding; hidden]``, ``transformer_layer``, ``final_layernorm``). Where it does
*not* match, and what this module does instead:

1. **Inputs**: ``MultiTokenPredictionLayer.forward`` rolls ``input_ids`` / ``position_ids`` by one
   and embeds through the live embedding module (the embedding would get the MTP loss's gradient).
   We call its ``_proj_and_transformer_layer`` with our own inputs: ``E[ids_{t+1}]`` through a
   *detached* ``E`` (:func:`areal_npu.model.mtp_targets.build_mtp_targets`'s ``embed_ids``, so a
   segment's last token sees the pad id as in the FSDP2 engine) and the hidden state detached --
   the gradient isolation of our head.
2. **Depths**: Megatron builds one layer per depth and applies the decoder's RoPE (``pos_t``) at
   every depth; our head (and vLLM) reuses ``layers.0`` at ``pos_t + d - 1``. Equal at depth 1 only,
   so ``mtp.num_depths`` must be 1 here (refused otherwise).
3. **Layer**: Qwen3.5's MTP layer is a *gated* full-attention layer (``q_proj`` gives a query and an
   output gate per head; ``attn * sigmoid(gate)``): ``attention_output_gate=True`` in the layer's
   ``TransformerConfig``, with the fused ``linear_qkv`` per query group ``[q (Hq/G d); gate (Hq/G d);
   k (d); v (d)]``. Its norms are zero-centred (``(1 + w) x / rms(x)``); the local spec's torch
   RMSNorm has no zero-centred mode, so the Megatron weight is ``1 + w`` (exact in the forward and
   the gradient; the export's ``w = (1 + w) - 1`` rounds within one float32 ulp of 1).
4. **Loss**: ``GPTModel``'s MTP loss needs ``MTPLossLoggingHelper`` (CUDA) and normalises per
   micro-batch; ours is :func:`areal_npu.model.mtp_loss.mtp_loss` with global per-depth counts.

Tensor parallelism: the layer is TP-sharded like the decoder (``linear_qkv`` by query groups with
the gate inside each group, ``eh_proj`` by output rows and gathered by Megatron), the embedding
lookup and the loss run on the vocabulary shards (:func:`vocab_parallel_embedding`,
:func:`vocab_parallel_mtp_loss`). Context parallelism: the targets (``ids_{t+1}`` to embed,
``ids_{t+2}`` to predict) are built on the whole packed row, where the next tokens of a CP rank's
chunk lie on another rank, and then split in the zigzag order of the tokens
(:func:`mtp_targets`); the layer's attention is the decoder's CP attention. Pipeline stages: the
layer lives on the last stage (beside the output head), which holds a copy of the first stage's
embedding shard for ``E[ids_{t+1}]``, refreshed from it before every training step (the copy is
read detached, so nothing flows back). Scope: joint training (``mtp.train`` without ``mtp_only``),
refused otherwise with a sentence.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from areal_npu import names
from areal_npu.config import ConfigError
from areal_npu.model.mtp import MTPConfig
from areal_npu.train.megatron import convert
from areal_npu.train.megatron.convert import LAYER_TABLE, Rule
from areal_npu.train.megatron.shape import GPTShape

__all__ = [
    "MTP_MODULE",
    "MTP_RULES",
    "build_mtp_layer",
    "check_mtp",
    "head_state",
    "mtp_forward",
    "mtp_hf_to_mcore",
    "mtp_mcore_to_hf",
    "mtp_targets",
    "vocab_parallel_embedding",
    "vocab_parallel_mtp_loss",
]

#: The prefix of the MTP layer's parameters in the engine's Megatron names
#: (``MegatronEngine.named_mcore_parameters``, the checkpoint's optimizer shards).
MTP_MODULE = "mtp_layer."

#: HF ``mtp.*`` <-> Megatron ``MultiTokenPredictionLayer`` names; kinds as in :mod:`.convert`, plus
#: ``zc`` / ``zc_head_norm`` (zero-centred norms: Megatron holds ``1 + w``) and ``gated_qkv``.
_ZC = convert.ZERO_CENTRED
MTP_RULES: tuple[Rule, ...] = (
    Rule(("mtp.fc.weight",), "eh_proj.weight", "column"),
    Rule(("mtp.pre_fc_norm_embedding.weight",), "enorm.weight", "zc"),
    Rule(("mtp.pre_fc_norm_hidden.weight",), "hnorm.weight", "zc"),
    Rule(("mtp.norm.weight",), "final_layernorm.weight", "zc"),
) + tuple(
    Rule(
        tuple(h.replace("model.layers.{i}.", "mtp.layers.0.") for h in r.hf),
        r.mcore.replace("decoder.layers.{i}.", "transformer_layer."),
        _ZC.get(r.kind, r.kind),
    )
    for r in LAYER_TABLE
)


def check_mtp(mtp_config: MTPConfig) -> None:
    """What the Megatron engine's MTP head cannot do yet, refused before any work (naming the key).
    Any TP, CP and PP size works (with or without sequence parallelism)."""
    if not mtp_config.enabled:
        return
    if mtp_config.num_depths != 1:
        raise ConfigError(
            "mtp.num_depths", f"the Megatron engine trains MTP depth 1 only (got {mtp_config.num_depths}): "
            "Megatron-Core applies the decoder's RoPE at every depth, our head (and vLLM) pos + d - 1",
        )  # fmt: skip
    if not mtp_config.train or mtp_config.mtp_only:
        raise ConfigError(
            "mtp.train" if not mtp_config.train else "mtp.mtp_only",
            "the Megatron engine trains the MTP head jointly with the policy only (mtp.train=true, "
            "mtp.mtp_only=false); use train.backend=fsdp2 for a frozen head or MTP-only training",
        )


def head_state(lm, mtp, mtp_config: MTPConfig | None) -> dict[str, torch.Tensor] | None:
    """The head's ``mtp.*`` tensors for the engine: from ``mtp`` (a
    :class:`areal_npu.model.mtp.Qwen35MTP`) or, without one, read from the checkpoint ``lm`` was
    loaded from (``lm.config.name_or_path``) as the FSDP2 path does (``mtp.init_new_head``: a new
    head). ``None`` when MTP is off."""
    if mtp is None and mtp_config is not None and mtp_config.enabled:
        from areal_npu.model.mtp_checkpoint import attach_mtp

        check_mtp(mtp_config)  # before loading anything
        mtp = attach_mtp(lm, mtp_config, getattr(lm.config, "name_or_path", None) or None)
    return {names.MTP_PREFIX + n: p for n, p in mtp.state_dict().items()} if mtp is not None else None


def mtp_transformer_config(
    hf_config,
    tp_size: int = 1,
    dtype=torch.float32,
    cpu_init: bool = True,
    recompute: bool = False,
    cp_size: int = 1,
):
    """The decoder's ``TransformerConfig`` plus Qwen3.5's output gate (the MTP layer's attention);
    never sequence-parallel (the engine hands it the gathered hidden states)."""
    from areal_npu.train.megatron.model import transformer_config

    return transformer_config(
        hf_config,
        tp_size=tp_size,
        cp_size=cp_size,
        dtype=dtype,
        cpu_init=cpu_init,
        recompute=recompute,
        attention_output_gate=True,
    )


def build_mtp_layer(
    hf_config, tp_size: int = 1, dtype=torch.float32, device=None, recompute: bool = False, cp_size: int = 1
):
    """Megatron's ``MultiTokenPredictionLayer`` with the engine's local layer spec (packed core
    attention) and local norms / column-parallel ``eh_proj``. Needs the parallel state.
    ``recompute``: the layer is recomputed in backward while training (:func:`mtp_forward`)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionLayer,
        get_mtp_layer_spec_for_backend,
    )

    from areal_npu.platform import current_platform
    from areal_npu.train.megatron.specs import layer_spec

    platform = current_platform()
    cfg = mtp_transformer_config(hf_config, tp_size, dtype, platform.device_type == "cpu", recompute, cp_size)
    spec = get_mtp_layer_spec_for_backend(layer_spec(), LocalSpecProvider())
    layer = MultiTokenPredictionLayer(
        config=cfg,
        submodules=spec.submodules,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    )
    # Megatron's local norms (enorm, hnorm, final_layernorm) are built in float32 whatever
    # params_dtype (Megatron casts the whole model in its Float16Module): the compute dtype here
    for p in layer.parameters():
        p.data = p.data.to(dtype)
    return layer.to(device=device or platform.current_device())


def vocab_parallel_embedding(ids, weight_shard, vocab_start: int, group=None) -> torch.Tensor:
    """``E[ids]`` from this rank's rows ``vocab_start ..`` of ``E`` (detached: no gradient reaches
    the embedding), summed over the TP group (each id lives on one rank)."""
    import torch.distributed as dist

    local = ids - vocab_start
    mine = (local >= 0) & (local < weight_shard.shape[0])
    out = F.embedding(local.clamp(0, weight_shard.shape[0] - 1), weight_shard.detach()) * mine[:, None]
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def mtp_forward(
    layer, hidden, embed_ids, embed_weight, rotary_pos_emb, packed_seq_params, vocab_start=0, tp_group=None
) -> torch.Tensor:
    """Depth-1 post-norm MTP hidden state ``[t, H]``: ``hidden`` ``[t, H]`` (decoder final norm, all
    tokens) and ``embed_weight`` (this rank's vocabulary rows) are used detached; ``embed_ids``
    ``[t]`` = ``ids_{t+1}`` (item 1 of the module docstring); ``rotary_pos_emb`` the decoder's table
    (positions ``pos_t``).

    With recomputation (``recompute_granularity == "full"``, training) the layer goes through
    Megatron's own ``MultiTokenPredictionLayer._checkpointed_forward``. Two differences from its
    ``forward``: the non-tensor ``packed_seq_params`` is bound in a closure (``CheckpointFunction``
    saves every positional argument with ``save_for_backward``, which takes tensors only), and the
    detached hidden state is a fresh leaf that requires grad (a checkpointed function whose inputs
    need no gradient has an output that needs none: the layer's weights would get no gradient). That
    leaf's gradient is dropped, so the isolation stays."""
    decoder_input = vocab_parallel_embedding(embed_ids.to(hidden.device), embed_weight, vocab_start, tp_group)
    run = functools.partial(
        layer._proj_and_transformer_layer,
        attention_mask=None,
        rotary_pos_emb=rotary_pos_emb,
        packed_seq_params=packed_seq_params,
    )
    inputs = dict(hidden_states=hidden.detach()[:, None], decoder_input=decoder_input[:, None])
    if layer.config.recompute_granularity == "full" and layer.training:
        inputs["hidden_states"].requires_grad_(True)
        return layer._checkpointed_forward(run, **inputs)[:, 0]
    return run(**inputs)[:, 0]


def mtp_targets(mbs, plan, samples, pad_token_id: int, device, dp_group, loss_scale: float) -> list:
    """Per micro-batch the head's :class:`areal_npu.train.forward.MTPArgs`: its depth-1 targets,
    built as the FSDP2 engine builds them (from the whole packed row and its token-aligned loss
    mask) and then cut to this CP rank's zigzag share, and the global count over the DP group
    (counted before the cut: the CP ranks share one batch)."""
    import torch.distributed as dist

    from areal_npu.data.packed_layout import pack_per_token
    from areal_npu.model.mtp_targets import build_mtp_targets, split_mtp_targets_for_cp
    from areal_npu.train.dist import reduce_floats
    from areal_npu.train.forward import IGNORE, MTPArgs

    out, local = [], 0
    for indices, mb in zip(plan, mbs):
        packed = mb.batch
        mask = pack_per_token([samples[i].loss_mask.to(torch.bool) for i in indices], packed, False)
        targets = build_mtp_targets(
            packed.input_ids, 1, packed.cu_seqlens, mask, packed.valid_mask, pad_token_id, IGNORE
        )
        n_valid = targets.valid_counts()[0]
        targets = split_mtp_targets_for_cp(targets, packed.cu_seqlens, mb.cp_size, mb.cp_rank)
        targets.embed_ids, targets.labels = targets.embed_ids.to(device), targets.labels.to(device)
        out.append(MTPArgs(targets, loss_scale))
        local += n_valid
    counts = [int(c) for c in reduce_floats([float(local)], dist.ReduceOp.SUM, dp_group)]
    for a in out:
        a.counts = counts
    return out


def vocab_parallel_mtp_loss(
    mtp_hidden,
    weight_shard,
    labels,
    count: int,
    loss_scale: float,
    vocab_start=0,
    chunk_size=2048,
    group=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`areal_npu.model.mtp_loss.mtp_loss` for one depth on a vocabulary-sharded head (used
    detached): ``loss_scale * CE / count`` and the ``mtp/*`` stats. Accuracy: the label's logit is
    the largest (ties count as hits; the unsharded kernel's argmax picks one of them)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from areal_npu.train.forward import IGNORE
    from areal_npu.train.megatron.logprobs import head_logits, vocab_parallel_logprobs_entropy

    tp = dist.get_world_size(group) if group is not None else 1
    labels = labels.reshape(-1).to(mtp_hidden.device)
    keep = (labels != IGNORE).nonzero().view(-1)
    h, y = mtp_hidden.index_select(0, keep), labels.index_select(0, keep)
    w = weight_shard.detach()
    if tp > 1:
        h = copy_to_tensor_model_parallel_region(h, group=group)  # backward: sum of the shards' parts
    logp, _ = vocab_parallel_logprobs_entropy(
        h, w, y, vocab_start=vocab_start, chunk_size=chunk_size, group=group if tp > 1 else None
    )
    hits = 0.0
    with torch.no_grad():
        for a in range(0, h.shape[0], chunk_size):
            z = head_logits(h[a : a + chunk_size], w)  # no float32 copy of the head
            local = y[a : a + chunk_size] - vocab_start
            mine = (local >= 0) & (local < w.shape[0])
            label_logit = z.gather(-1, local.clamp(0, w.shape[0] - 1)[:, None])[:, 0]
            both = torch.stack([z.max(-1).values, torch.where(mine, label_logit, -torch.inf)])
            if tp > 1:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            hits += float((both[1] >= both[0]).sum())
    denom = max(int(count), 1)
    loss_d = -logp.sum() / denom
    loss = loss_d * loss_scale
    stats = {
        names.mtp_loss_key(1): float(loss_d.detach()),
        names.mtp_acc_key(1): hits / denom,
        names.mtp_count_key(1): float(keep.numel()),
        names.MTP_LOSS: float(loss.detach()),
    }
    return loss, stats


# ---- weights ------------------------------------------------------------------------------------
def _shard(rule: Rule, tensors, shape: GPTShape, tp_rank: int, tp_size: int) -> torch.Tensor:
    return convert.shard(rule.kind, tensors, shape, tp_rank, tp_size)


def _unshard(rule: Rule, shards, shape: GPTShape, grads: bool = False) -> list[torch.Tensor]:
    return convert.unshard(rule.kind, shards, shape, grads)


def mtp_hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], shape: GPTShape, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """This TP rank's ``MultiTokenPredictionLayer`` state dict from the HF ``mtp.*`` tensors (layers
    ``1..`` of a multi-layer head are never drafted by vLLM, see :mod:`areal_npu.model.mtp`: ignored)."""
    out = {}
    for rule in MTP_RULES:
        missing = [h for h in rule.hf if h not in hf_state]
        if missing:
            raise KeyError(f"the MTP head lacks {missing} (for {rule.mcore})")
        out[rule.mcore] = _shard(rule, [hf_state[h] for h in rule.hf], shape, tp_rank, tp_size).contiguous()
    return out


#: MTP layer tensors split over TP ranks, and the replicated ones whose gradient is partial over TP
#: (the per-head q/k norms, as in the decoder).
MTP_TP_SHARDED = frozenset(r.mcore for r in MTP_RULES if r.kind in ("column", "row", "gated_qkv", "gate_up"))
MTP_TP_PARTIAL = tuple(r.mcore for r in MTP_RULES if r.kind == "zc_head_norm")


def mtp_mcore_to_hf(named: Mapping[str, torch.Tensor], shape: GPTShape, tp_group=None, grads: bool = False):
    """(``mtp.*`` HF name, full CPU tensor) from this rank's MTP layer tensors (collective over TP).
    ``grads``: the tensors are gradients (a zero-centred norm's gradient w.r.t. ``w`` is the one
    w.r.t. ``1 + w``: no shift)."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    for rule in MTP_RULES:
        local = named[rule.mcore].detach()
        if rule.kind in ("zc", "zc_head_norm", "replicated", "head_norm") or tp == 1:
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
        full = _unshard(rule, shards, shape, grads)
        for name, tensor in zip(rule.hf, full):
            yield name, tensor.to("cpu", copy=True).contiguous()  # not a view of live grads
