"""The Megatron-Core train engine: packed THD micro-batches, TP / CP / DP, decoupled PPO (or SFT).

It implements :class:`areal_npu.train.protocol.TrainEngine` as :class:`areal_npu.train.fsdp2.FSDPEngine`
does (same samples, same loss objects, same stats keys, same export format): :meth:`compute_logprobs`,
:meth:`train_step` (= :meth:`forward_backward` + :meth:`optimizer_step`), :meth:`full_state_dict` /
:meth:`export_buckets` (HF names), and checkpoints through :mod:`areal_npu.train.megatron.checkpoint`.
Its config is the recipe's ``train`` section with ``backend: megatron`` (layout: ``train.megatron``).

Layout: world = tp * cp * dp (pp = 1). Every rank calls every method; the ranks of one TP x CP
group pass the *same* samples (their data-parallel rank's share), which is checked. Inside, each
sequence is shifted to prediction alignment before packing (as in the FSDP2 engine), packed with
``alignment = tp`` (or ``2 tp cp``) and CP tail padding, and each CP rank keeps its zigzag share
(:mod:`areal_npu.train.megatron.packing`). Log-probs come from the TP-sharded head through
:mod:`areal_npu.train.megatron.logprobs`. Losses are normalised by global counts over micro-batches
and DP ranks; each CP rank's loss covers its tokens, so gradients are *summed* over the DP x CP
group (TP reductions happen inside Megatron's layers), and the per-head q/k norms' partial
gradients over TP.

Not wired yet (each refused by :func:`areal_npu.train.megatron.config.check_megatron_config` / the
constructor with a sentence):
pipeline parallelism, sequence parallelism (local-spec norms refuse it; gloo has no
reduce-scatter), recomputation, bf16 with fp32 master weights / Megatron's DistributedOptimizer
(this engine steps a plain ``torch.optim.AdamW`` on its local shards), and the MTP head. For MTP
the facts a next step needs, checked on this CPU: ``mtp_num_layers=1`` with this layer spec builds
``mtp.layers.0.{enorm, hnorm, eh_proj [H, 2H], transformer_layer.*, final_layernorm}`` and its
packed forward runs (``GPTModel``'s own MTP *loss* path needs ``MTPLossLoggingHelper`` on CUDA, so
call ``model.mtp`` directly and use :func:`areal_npu.model.mtp_loss.mtp_loss`). Mapping to our
``mtp.*`` names: ``pre_fc_norm_embedding`` -> ``enorm``, ``pre_fc_norm_hidden`` -> ``hnorm`` (both
concatenate embedding first), ``fc`` -> ``eh_proj``, ``layers.0.*`` ->
``transformer_layer.*`` (the layer table of :mod:`.convert`), ``norm`` -> ``final_layernorm``; our
norms are zero-centred, so the Megatron weight is ``1 + w`` (the local spec's torch norm has no
zero-centred mode). Exact only for one depth: Megatron builds a *separate* layer per depth and
applies the decoder's RoPE (position ``t``) at every depth, while our head (and vLLM's drafter)
reuses ``layers.0`` at position ``t + d - 1``. Gradient isolation needs ``hidden.detach()``, an
embedding wrapper that detaches (``MultiTokenPredictionLayer`` calls the shared embedding module
itself) and the detached head in the loss. The project's MTP heads sit on Qwen3.5 backbones
(Gated DeltaNet), which Megatron-Core 0.16 cannot build, so no CPU model exists here to check such
a mapping against end to end.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from areal_npu.algo.guard import NonFiniteError
from areal_npu.config import ConfigError
from areal_npu.data.context_parallel import cp_gather
from areal_npu.data.packed_layout import pack_sequences, unpack_per_token
from areal_npu.data.packing import packing_stats, plan_micro_batches
from areal_npu.data.sample import TrainSample, truncate_sample
from areal_npu.model.mtp import MTPConfig
from areal_npu.platform import current_platform
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import all_reduce_flat, reduce_floats
from areal_npu.train.forward import prediction_fields
from areal_npu.train.losses import Loss
from areal_npu.train.megatron import convert
from areal_npu.train.megatron.config import check_loss_layout, check_megatron_config
from areal_npu.train.megatron.logprobs import vocab_parallel_logprobs_entropy
from areal_npu.train.megatron.model import build_gpt_model, decoder_hidden_states, gpt_shape
from areal_npu.train.megatron.packing import MegatronMicroBatch, to_megatron
from areal_npu.train.megatron.runtime import init_parallel_state
from areal_npu.train.optim import build_optimizer
from areal_npu.train.stats import merge_stats, minibatch_train_step

__all__ = ["MegatronEngine"]


class MegatronEngine:
    """Trains a Megatron-Core ``GPTModel`` built from an HF config and state dict (full tensors,
    HF names; each rank keeps its TP shards). Expects ``torch.distributed`` to be initialised."""

    def __init__(
        self,
        hf_config,
        hf_state: Mapping[str, torch.Tensor],
        config: TrainEngineConfig,
        mtp_config: MTPConfig | None = None,
        pad_token_id: int = 0,
    ):
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (areal_npu.train.dist.init_distributed)")
        self.platform = current_platform()
        config.validate()
        if config.backend != "megatron":
            raise ValueError(f"the Megatron engine got a train config for backend {config.backend!r}")
        check_megatron_config(config)
        self.config = config
        self.mtp_config = mtp_config or MTPConfig(enabled=False)
        check_mtp(self.mtp_config)
        self.pad_token_id = pad_token_id
        self.device = self.platform.current_device()
        self.version = 0
        self.mtp = None  # the interface's MTP head slot (no head yet)
        self.hf_config = hf_config
        self.shape = gpt_shape(hf_config)

        layout = config.megatron
        init_parallel_state(layout.tp_size, layout.cp_size, layout.pp_size)
        from megatron.core import parallel_state as ps

        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_group = ps.get_context_parallel_group()
        self.cp_rank = ps.get_context_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        self.tp_cp_group = ps.get_tensor_and_context_parallel_group()

        self.module = build_gpt_model(
            hf_config, tp_size=layout.tp_size, cp_size=layout.cp_size, device=self.device
        )
        state = convert.hf_to_mcore(hf_state, self.shape, self.tp_rank, layout.tp_size)
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(f"Megatron state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        # Megatron marks TP-sharded weights (``tensor_model_parallel``) only when it initialises
        # them; ours are loaded (perform_initialization=False), so the conversion table marks them.
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        named = dict(self.module.named_parameters())
        self._tp_sharded = set(convert.tp_partition_dims(self.shape))
        self._tp_partial = convert.tp_partial_grad_names(self.shape)
        for name, dim in convert.tp_partition_dims(self.shape).items():
            if not hasattr(named[name], "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(named[name], True, dim, 1)
        self.vocab_start = self.tp_rank * (self.shape.vocab_size // layout.tp_size)
        params = [p for _, p in self.module.named_parameters()]
        self.optimizer, self.scheduler = build_optimizer([{"params": params}], config.optim)

    # ---- construction helpers ------------------------------------------------------------------
    @classmethod
    def from_hf_model(cls, lm: torch.nn.Module, config: TrainEngineConfig, **kwargs) -> MegatronEngine:
        """From a transformers causal LM (its config and full state dict)."""
        return cls(lm.config, lm.state_dict(), config, **kwargs)

    # ---- batching ------------------------------------------------------------------------------
    def _fit_cap(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        if self.config.packing.on_too_long != "truncate":
            return list(samples)
        return [truncate_sample(s, self.config.packing.max_tokens_per_mb) for s in samples]

    def _check_same_samples(self, samples: Sequence[TrainSample]) -> None:
        """The TP x CP ranks of one model replica must hold the same batch (cheap fingerprint)."""
        if dist.get_world_size(self.tp_cp_group) == 1:
            return
        ids_sum = sum(int(s.input_ids.sum()) for s in samples)
        mine = [float(len(samples)), float(sum(len(s) for s in samples)), float(ids_sum)]
        hi = reduce_floats(mine, dist.ReduceOp.MAX, self.tp_cp_group)
        lo = [-x for x in reduce_floats([-x for x in mine], dist.ReduceOp.MAX, self.tp_cp_group)]
        if hi != lo:
            raise ValueError(
                "the tensor/context-parallel ranks of one replica were given different samples; "
                "give every rank of a TP x CP group its data-parallel rank's share"
            )

    def _micro_batches(self, samples: Sequence[TrainSample], loss: Loss | None):
        """(plan, micro-batches as this rank feeds them, packing stats)."""
        lengths = [len(s) for s in samples]
        plan = plan_micro_batches(lengths, self.config.packing, group=self.dp_group)
        cp = self.config.megatron.cp_size
        mbs = []
        pad_total = 0
        for indices in plan:
            seqs = [samples[i] for i in indices]
            packed = pack_sequences(
                [s.input_ids for s in seqs],
                alignment=self.config.packing.alignment,
                cp_size=cp,
                pad_token_id=self.pad_token_id,
                sample_indices=indices,
            )
            pad_total += packed.pad_tokens
            fields = prediction_fields(seqs, packed, loss)
            mbs.append(to_megatron(packed, fields, cp, self.cp_rank, self.cp_group, self.device))
        stats = packing_stats(
            lengths, [p for p in plan if p], self.config.packing.max_tokens_per_mb, pad_total
        )
        return plan, mbs, stats

    # ---- the forward ---------------------------------------------------------------------------
    def _output_weight(self) -> torch.Tensor:
        # GPTModel.shared_embedding_or_output_weight() answers the *embedding* on the first stage,
        # tied or not: only with tied embeddings is that the head.
        if self.shape.tie_word_embeddings:
            return self.module.shared_embedding_or_output_weight()
        return self.module.output_layer.weight

    def _logprobs(self, mb: MegatronMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, entropy) of this rank's tokens of ``mb`` (prediction-aligned, float32)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        hidden = decoder_hidden_states(self.module, mb.input_ids, mb.position_ids, mb.params)
        tp = dist.get_world_size(self.tp_group)
        if tp > 1:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        return vocab_parallel_logprobs_entropy(
            hidden,
            self._output_weight(),
            mb.fields["targets"],
            vocab_start=self.vocab_start,
            temperature=self.config.temperature,
            chunk_size=self.config.logprob_chunk_size,
            group=self.tp_group if tp > 1 else None,
        )

    def _gather_cp(self, local: torch.Tensor, mb: MegatronMicroBatch) -> torch.Tensor:
        """This micro-batch's full packed tensor from every CP rank's zigzag share (no grad)."""
        if mb.cp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(mb.cp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.cp_group)
        return cp_gather(parts, mb.batch.cu_seqlens)

    # ---- public operations ---------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """Token-aligned log-probs of every sample under the current weights (position 0 is 0);
        the same on every rank of a TP x CP group."""
        samples = self._fit_cap(samples)
        self._check_same_samples(samples)
        self.module.eval()
        plan, mbs, _ = self._micro_batches(samples, None)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for indices, mb in zip(plan, mbs):
            logp, _ = self._logprobs(mb)
            full = self._gather_cp(logp, mb)
            for i, pred in zip(indices, unpack_per_token(full.float().cpu(), mb.batch)):
                out[i] = torch.cat([pred.new_zeros(1), pred[:-1]])
        return out

    def train_step(
        self, samples: Sequence[TrainSample], loss: Loss, step: int | None = None
    ) -> dict[str, float]:
        """``ppo_minibatches`` optimizer steps over interleaved slices, one version bump (as FSDP2)."""
        return minibatch_train_step(self, samples, loss, step, self.config.ppo_minibatches)

    def forward_backward(
        self, samples: Sequence[TrainSample], loss: Loss, step: int | None = None
    ) -> dict[str, float]:
        """Accumulate one step's gradients over packed micro-batches (samples and losses as
        :meth:`areal_npu.train.fsdp2.FSDPEngine.forward_backward`); returns global stats."""
        check_loss_layout(loss, self.config.megatron.cp_size)  # before any work
        step = self.version if step is None else step
        cap = self.config.packing.max_tokens_per_mb
        truncated = sum(len(s) > cap for s in samples)
        samples = loss.check(self._fit_cap(samples), step)
        self._check_same_samples(samples)
        plan, mbs, pack_stats = self._micro_batches(samples, loss)

        # global counts: over micro-batches and data-parallel ranks (TP/CP ranks hold copies)
        local_tokens = float(sum(int(s.loss_mask[1:].sum()) for s in samples))  # shifted: t predicts t+1
        n_tokens = reduce_floats([local_tokens], dist.ReduceOp.SUM, self.dp_group)[0]
        n_seqs = reduce_floats(
            [float(sum(bool(s.loss_mask[1:].any()) for s in samples))], dist.ReduceOp.SUM, self.dp_group
        )[0]
        denominator = loss.denominator(n_tokens, n_seqs)

        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        per_mb_stats = []
        for mb in mbs:
            logp, entropy = self._logprobs(mb)
            cu_seqlens = mb.params.cu_seqlens_q if mb.cp_size == 1 else None
            main, stats = loss(
                logp, entropy, mb.fields, denominator=denominator, cu_seqlens=cu_seqlens, policy_version=self.version
            )
            main.backward()
            per_mb_stats.append((float(mb.fields["loss_mask"].sum()), stats))
        self._reduce_gradients()
        stats = merge_stats(per_mb_stats, self.dp_cp_group)
        stats.update(pack_stats)
        if self.config.packing.on_too_long == "truncate":
            stats["packing/truncated_sequences"] = float(truncated)
        stats["train/n_tokens"] = n_tokens
        return stats

    def _reduce_gradients(self) -> None:
        """Sum gradients over the DP x CP group (each rank's loss covers its own tokens), and the
        per-head q/k norms' partial gradients over TP (each TP rank normalises its own heads)."""
        named = dict(self.module.named_parameters())
        if dist.get_world_size(self.tp_group) > 1:
            all_reduce_flat(
                [named[n].grad for n in self._tp_partial if named[n].grad is not None], self.tp_group
            )
        if dist.get_world_size(self.dp_cp_group) > 1:
            all_reduce_flat([p.grad for p in named.values() if p.grad is not None], self.dp_cp_group)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient: TP-sharded parameters summed over the TP group,
        replicated ones (norms) counted once."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.module.named_parameters():
            if p.grad is None:
                continue
            sq = p.grad.double().pow(2).sum()
            if name in self._tp_sharded:
                sharded += sq
            else:
                replicated += sq
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return float((sharded + replicated).sqrt())

    def optimizer_step(self, step: int | None = None, bump_version: bool = True) -> dict[str, float]:
        """Clip (global norm over TP shards), check and apply the gradients; bumps the version."""
        step = self.version if step is None else step
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(step, "grad_norm", f"step {step}: gradient norm {norm}; update not applied")
        clip = self.config.optim.grad_clip
        if clip > 0 and norm > clip:
            scale = clip / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        self.scheduler.step()
        if bump_version:
            self.version += 1
        return {
            "train/grad_norm": norm,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/version": float(self.version),
        }

    # ---- weights -------------------------------------------------------------------------------
    def named_mcore_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under Megatron names (TP shards)."""
        return dict(self.module.named_parameters())

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full CPU tensor) for every weight. Collective over the TP group: every rank
        iterates (ranks of other TP groups hold copies and may iterate too)."""
        return convert.gathered_hf_tensors(self.named_mcore_parameters(), self.shape, self.tp_group)

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients under HF names, full tensors (collective over TP)."""
        grads = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for n, p in self.module.named_parameters()
        }
        return dict(convert.gathered_hf_tensors(grads, self.shape, self.tp_group))

    def export_buckets(self, bucket_bytes: int = 256 << 20, kinds: Sequence[str] = ("policy", "mtp")):
        """Weights for the rollout sync in size-bounded buckets, ``(kind, [(hf_name, tensor), ...])``,
        as :meth:`areal_npu.train.fsdp2.FSDPEngine.export_buckets` (``mtp``: no head, nothing).
        Collective over the TP group."""
        unknown = sorted(set(kinds) - {"policy", "mtp", "vision"})
        if unknown:
            raise ValueError(f"unknown export kinds {unknown}; expected policy, mtp or vision")
        if "policy" not in kinds:
            return
        for bucket in convert.export_buckets(self.full_state_dict(), bucket_bytes):
            yield "policy", bucket

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, root, extra: dict | None = None, tokenizer=None, keep_last: int = 2):
        """``<root>/step_<version>``, atomic (see :mod:`areal_npu.train.megatron.checkpoint`). Collective."""
        from areal_npu.train.megatron.checkpoint import save_checkpoint

        return save_checkpoint(self, root, extra, tokenizer, keep_last)

    def load_checkpoint(self, path) -> dict:
        """Restore a checkpoint of :meth:`save_checkpoint`; returns the caller's ``extra``. Collective."""
        from areal_npu.train.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def save_hf_checkpoint(self, out_dir, tokenizer=None):
        """The weights as a Hugging Face checkpoint under HF names. Collective over TP; rank 0 writes."""
        from areal_npu.train.megatron.checkpoint import write_hf_checkpoint

        return write_hf_checkpoint(self, out_dir, tokenizer)


def check_mtp(mtp_config: MTPConfig) -> None:
    """The Megatron engine trains no MTP head yet (refused before any work, naming the key)."""
    if mtp_config.enabled:
        raise ConfigError(
            "mtp.enabled", "the Megatron engine does not train an MTP head yet; set mtp.enabled=false or use "
            "train.backend=fsdp2",
        )  # fmt: skip
