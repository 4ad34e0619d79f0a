"""The Megatron-Core train engine: packed THD micro-batches, TP / CP / DP, decoupled PPO (or SFT).

It implements :class:`areal_npu.train.protocol.TrainEngine` as :class:`areal_npu.train.fsdp2.FSDPEngine`
does (same samples, same loss objects, same stats keys, same export format): the cap, packing, the
step's counts, loss and stats are theirs in common (:class:`areal_npu.train.base.TrainEngineBase`);
here the model, its forward per micro-batch (or per pipeline stage), the gradient reduction, the
optimizer step, :meth:`full_state_dict` / :meth:`export_buckets` (HF names), and checkpoints through
:mod:`areal_npu.train.megatron.checkpoint`.
Its config is the recipe's ``train`` section with ``backend: megatron`` (layout: ``train.megatron``).

Layout: world = tp * cp * pp * dp. Every rank calls every method; the ranks of one TP x CP x PP
group pass the *same* samples (their data-parallel rank's share), which is checked. Pipeline stages
(``pp_size`` > 1) run Megatron-Core's 1F1B schedule (:mod:`.pipeline`). Inside, each sequence is
shifted to prediction alignment before packing (as in the FSDP2 engine), packed with ``alignment =
tp`` (or ``2 tp cp``) and CP tail padding, and each CP rank keeps its zigzag share
(:mod:`areal_npu.train.megatron.packing`). Log-probs come from the TP-sharded head through
:mod:`areal_npu.train.megatron.logprobs`. Losses are normalised by global counts over micro-batches
and DP ranks; each CP rank's loss covers its tokens, so gradients are *summed* over the DP x CP
group (TP reductions happen inside Megatron's layers), and the per-head q/k norms' partial
gradients over TP.

The MTP head (``mtp.*``, joint training, depth 1, any TP, CP and PP) is Megatron-Core's
``MultiTokenPredictionLayer`` fed our inputs and trained with our loss (:mod:`.mtp`: where
Megatron's block differs from our head and what is done instead); it has its own optimizer group
(``lr x mtp.lr_scale``) and is clipped apart from the policy, as in the FSDP2 engine. With pipeline
stages it lives on the last one, which holds a copy of the first stage's embedding shard
(:meth:`MegatronEngine._copy_embedding_to_last_stage`, before every training step); its norm,
weights and optimizer metadata reach the other stages by broadcast (:mod:`.pipeline`).

``train.dtype`` is the compute dtype (bf16 or float32): fp32 master weights, fp32 gradient
accumulation and reduction (reduce-scattered, as Megatron's DistributedOptimizer does), and AdamW's
states sharded over DP x CP (ZeRO-1; our own, not Megatron's DistributedOptimizer: :mod:`.precision`
says why).

Recomputation (``train.gradient_checkpointing``) is Megatron's own (:func:`.model.recompute_fields`).
Not wired yet (each refused by :func:`areal_npu.train.megatron.config.check_megatron_config`,
:func:`areal_npu.train.megatron.mtp.check_mtp` or the constructor with a sentence): tied embeddings
with pipeline stages, interleaved (virtual) pipeline stages. Qwen3.5 hybrids run
every layout whose TP x CP ranks divide their Gated DeltaNet heads (:mod:`.hybrid`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES
from areal_npu.data.context_parallel import cp_gather
from areal_npu.model.layout import TEXT, CheckpointLayout
from areal_npu.model.mtp import MTPConfig
from areal_npu.names import MTP_PREFIX
from areal_npu.platform import current_platform
from areal_npu.train.base import TrainEngineBase
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import all_reduce_flat
from areal_npu.train.forward import MTPArgs
from areal_npu.train.losses import Loss
from areal_npu.train.megatron import convert
from areal_npu.train.megatron.config import check_loss_layout, check_megatron_config
from areal_npu.train.megatron.grads import sharded_grad_norm
from areal_npu.train.megatron.logprobs import vocab_parallel_logprobs_entropy
from areal_npu.train.megatron.model import build_gpt_model, decoder_hidden_states, model_options
from areal_npu.train.megatron.mtp import (
    MTP_MODULE,
    MTP_TP_PARTIAL,
    MTP_TP_SHARDED,
    build_mtp_layer,
    check_mtp,
    head_state,
    mtp_forward,
    mtp_hf_to_mcore,
    mtp_mcore_to_hf,
    mtp_targets,
    vocab_parallel_mtp_loss,
)
from areal_npu.train.megatron.packing import MegatronMicroBatch, check_same_samples, to_megatron
from areal_npu.train.megatron.pipeline import from_last_stage, run_pipeline, stream_from_last_stage
from areal_npu.train.megatron.precision import MasterOptimizer, optimizer_step
from areal_npu.train.megatron.runtime import init_parallel_state
from areal_npu.train.megatron.shape import gpt_shape
from areal_npu.train.megatron.stream import StateSource, load_rank_weights

__all__ = ["MegatronEngine"]


class MegatronEngine(TrainEngineBase):
    """Trains a Megatron-Core ``GPTModel`` built from an HF config and ``hf_state``: a state dict
    (full tensors, HF names) or a :class:`~areal_npu.model.safetensors_reader.SafetensorsReader`
    (:meth:`from_checkpoint`: only this rank's shards are read); with ``mtp.enabled``, its MTP head from
    ``mtp_state`` (``mtp.*`` HF names). Expects ``torch.distributed`` to be initialised."""

    def __init__(
        self,
        hf_config,
        hf_state: Mapping[str, torch.Tensor],
        config: TrainEngineConfig,
        mtp_config: MTPConfig | None = None,
        pad_token_id: int = 0,
        mtp_state: Mapping[str, torch.Tensor] | None = None,
        layout: CheckpointLayout | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (areal_npu.train.dist.init_distributed)")
        self.platform = current_platform()
        config.validate()
        if config.backend != "megatron":
            raise ValueError(f"the Megatron engine got a train config for backend {config.backend!r}")
        check_megatron_config(config)
        self.config = config
        self.mtp_config = mtp_config or MTPConfig(enabled=False)  # validated (the recipe's ``mtp``)
        check_mtp(self.mtp_config)
        if self.mtp_config.enabled and not mtp_state:
            raise ValueError("mtp.enabled but no MTP head was given (load one or set mtp.init_new_head)")
        self.pad_token_id = pad_token_id
        self.device = self.platform.current_device()
        self.version = 0
        self.mtp = None  # the interface's MTP head slot: Megatron's MultiTokenPredictionLayer
        self.hf_config = hf_config
        self.layout = layout or CheckpointLayout(TEXT)  # names of exports and saves (published: renamed)
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
        self.stats_group = self.dp_cp_group  # the TP ranks hold copies of the DP x CP ranks' tokens
        self.tp_cp_group = ps.get_tensor_and_context_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.stage = convert.Stage(ps.get_pipeline_model_parallel_rank(), layout.pp_size)

        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.module = build_gpt_model(hf_config, device=self.device, dtype=dtype, **model_options(config))
        # this rank's shards only, one tensor at a time, into the uninitialised parameters
        from_checkpoint = hasattr(hf_state, "read")  # a SafetensorsReader, not a state dict
        exact = load_rank_weights(
            self.module,
            hf_state if from_checkpoint else StateSource(hf_state),
            self.shape,
            self.tp_rank,
            layout.tp_size,
            self.stage,
            name_of=self.layout.checkpoint_name if from_checkpoint else str,
            skip=(lambda n: n.startswith(MTP_PREFIX) or self.layout.training_name(n) is None)
            if from_checkpoint
            else (lambda n: False),
        )
        # Megatron marks TP-sharded weights (``tensor_model_parallel``) only when it initialises
        # them; ours are loaded (perform_initialization=False), so the conversion table marks them.
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        named = dict(self.module.named_parameters())
        self._tp_sharded = set(convert.tp_partition_dims(self.shape, self.stage))
        # partial over TP: per-head q/k norms; under SP every norm (marked as Megatron marks them)
        self._tp_partial = convert.tp_partial_grad_names(self.shape, self.stage)
        self._tp_partial += [
            n
            for n, p in named.items()
            if getattr(p, "sequence_parallel", False) and n not in self._tp_partial
        ]
        for name, dim in convert.tp_partition_dims(self.shape, self.stage).items():
            if not hasattr(named[name], "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(named[name], True, dim, 1)
        self.vocab_start = self.tp_rank * (self.shape.vocab_size // layout.tp_size)
        groups = [{"named": named, "init": exact}]  # the masters from the loaded fp32 values
        self._mtp_embedding = None  # the last stage's copy of the first stage's embedding shard (pp > 1)
        if self.mtp_config.enabled and self.stage.last:  # the head lives beside the output layer
            recompute = config.gradient_checkpointing
            self.mtp = build_mtp_layer(hf_config, layout.tp_size, dtype, self.device, recompute, layout.cp_size)
            state = mtp_hf_to_mcore(mtp_state, self.shape, self.tp_rank, layout.tp_size)
            self.mtp.load_state_dict(state, strict=True)
            mtp_lr = config.optim.lr * self.mtp_config.lr_scale
            groups.append({"named": dict(self.mtp.named_parameters()), "init": state, "lr": mtp_lr})
        self.optimizer = MasterOptimizer(groups, config.optim, self.dp_cp_group)
        self.scheduler = self.optimizer.scheduler

    # ---- construction helpers ------------------------------------------------------------------
    @classmethod
    def from_hf_model(
        cls, lm: torch.nn.Module, config: TrainEngineConfig, mtp: torch.nn.Module | None = None, **kwargs
    ) -> MegatronEngine:
        """From a transformers causal LM (its config and full state dict) and, with ``mtp.enabled``,
        its head (:class:`areal_npu.model.mtp.Qwen35MTP`). Without ``mtp`` the head is read from the
        checkpoint ``lm`` was loaded from (``lm.config.name_or_path``), as the FSDP2 path does."""
        mtp_state = head_state(lm, mtp, kwargs.get("mtp_config"))
        return cls(lm.config, lm.state_dict(), config, mtp_state=mtp_state, **kwargs)

    @classmethod
    def from_checkpoint(
        cls, model_dir, config: TrainEngineConfig, mtp_config: MTPConfig | None = None, **kwargs
    ) -> MegatronEngine:
        """From an HF checkpoint directory (either layout, :mod:`areal_npu.model.layout`), each rank
        reading only its shards (:mod:`.stream`); the MTP head (one layer) is read whole."""
        from areal_npu.model.layout import config_and_layout
        from areal_npu.model.mtp_checkpoint import build_mtp_head
        from areal_npu.model.safetensors_reader import SafetensorsReader

        hf_config, layout = config_and_layout(model_dir)
        mtp_state = None
        if mtp_config is not None and mtp_config.enabled:
            check_mtp(mtp_config)  # before loading anything
            head = build_mtp_head(hf_config, mtp_config, model_dir)
            mtp_state = {MTP_PREFIX + n: p for n, p in head.state_dict().items()}
        reader = SafetensorsReader(model_dir)
        return cls(hf_config, reader, config, mtp_config, mtp_state=mtp_state, layout=layout, **kwargs)

    # ---- the steps the base leaves to the engine ------------------------------------------------
    def _check_loss(self, loss: Loss) -> None:
        check_loss_layout(loss, self.config.megatron.cp_size)

    def _check_same_samples(self, samples) -> None:
        check_same_samples(samples, self.tp_cp_group)
        check_same_samples(samples, self.pp_group)

    def _to_device(self, packed, fields) -> MegatronMicroBatch:
        """This rank's zigzag share of the row (CP) with the global ``PackedSeqParams``."""
        return to_megatron(packed, fields, self.config.megatron.cp_size, self.cp_rank, self.cp_group, self.device)

    def _loss_cu_seqlens(self, mb: MegatronMicroBatch):
        return mb.params.cu_seqlens_q if mb.cp_size == 1 else None

    def _mtp_args(self, plan, mbs, samples) -> list[MTPArgs | None]:
        if not self.mtp_config.enabled:  # every stage takes part in the targets' collectives
            return [None] * len(mbs)
        return mtp_targets(mbs, plan, samples, self.pad_token_id, self.device, self.dp_group, self.mtp_config.loss_scale)

    # ---- the forward ---------------------------------------------------------------------------
    def _output_weight(self) -> torch.Tensor:
        # GPTModel.shared_embedding_or_output_weight() answers the *embedding* on the first stage,
        # tied or not: only with tied embeddings is that the head.
        if self.shape.tie_word_embeddings:
            return self.module.shared_embedding_or_output_weight()
        return self.module.output_layer.weight

    def _logprobs(self, mb: MegatronMicroBatch, mtp_args: MTPArgs | None = None):
        """(logp, entropy, MTP loss or None, MTP stats) of this rank's tokens of ``mb``
        (prediction-aligned, float32); the MTP head runs when ``mtp_args`` (:func:`.mtp.mtp_targets`) is given."""
        hidden, rotary = decoder_hidden_states(
            self.module, mb.input_ids, mb.position_ids, mb.params, with_rotary=True
        )
        return self._head(hidden, mb, rotary, mtp_args)

    def _head(self, hidden: torch.Tensor, mb: MegatronMicroBatch, rotary=None, mtp_args: MTPArgs | None = None):
        """:meth:`_logprobs` from the decoder's final-norm hidden states ``[t, H]``."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        head_input = hidden
        tp = dist.get_world_size(self.tp_group)
        if tp > 1 and self.config.megatron.sequence_parallel:  # this rank's tokens -> all of them
            hidden = gather_from_sequence_parallel_region(hidden, True, group=self.tp_group)
            head_input = hidden  # backward: reduce-scatter of the vocab shards' partial gradients
        elif tp > 1:
            head_input = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        logp, entropy = vocab_parallel_logprobs_entropy(
            head_input,
            self._output_weight(),
            mb.fields["targets"],
            vocab_start=self.vocab_start,
            temperature=self.config.temperature,
            chunk_size=self.config.logprob_chunk_size,
            group=self.tp_group if tp > 1 else None,
        )
        if mtp_args is None:
            return logp, entropy, None, {}
        targets, group = mtp_args.targets, self.tp_group if tp > 1 else None
        embedding = (  # this rank's vocabulary rows
            self._mtp_embedding if self.stage.size > 1 else self.module.embedding.word_embeddings.weight
        )
        mtp_hidden = mtp_forward(
            self.mtp, hidden, targets.embed_ids[0], embedding, rotary, mb.params, self.vocab_start, group
        )
        aux, stats = vocab_parallel_mtp_loss(
            mtp_hidden,
            self._output_weight(),
            targets.labels[0],
            mtp_args.counts[0],
            mtp_args.loss_scale,
            self.vocab_start,
            self.config.logprob_chunk_size,
            group,
        )
        return logp, entropy, aux, stats

    def _gather_cp(self, local: torch.Tensor, mb: MegatronMicroBatch) -> torch.Tensor:
        """This micro-batch's full packed tensor from every CP rank's zigzag share (no grad)."""
        if mb.cp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(mb.cp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.cp_group)
        return cp_gather(parts, mb.batch.cu_seqlens)

    def _packed_logprobs(self, mbs: list[MegatronMicroBatch]):
        """The whole row's log-probs (the same on every rank of a TP x CP group)."""
        self.module.eval()
        if self.stage.size > 1:  # the last stage's head: log-probs, no loss

            def head(hidden, mb, rotary):
                return hidden.new_zeros(()), self._gather_cp(self._head(hidden, mb)[0], mb)

            per_mb = run_pipeline(self, mbs, head, forward_only=True)
        else:
            per_mb = [self._gather_cp(self._logprobs(mb)[0], mb) for mb in mbs]
        return [(mb.batch, full.float().cpu()) for mb, full in zip(mbs, per_mb)]

    def _accumulate(self, mbs: list[MegatronMicroBatch], mtp_args, mb_loss) -> list:
        self.module.train()
        if self.mtp is not None:
            self.mtp.train()
        self.optimizer.zero_grad()
        if self.stage.size > 1:  # Megatron's schedule runs the backward
            args = {id(mb): arg for mb, arg in zip(mbs, mtp_args)}
            self._copy_embedding_to_last_stage()

            def head(hidden, mb, rotary):
                return mb_loss(mb, *self._head(hidden, mb, rotary, args[id(mb)]))

            per_mb_stats = run_pipeline(self, mbs, head, forward_only=False)
        else:
            per_mb_stats = []
            for mb, mtp_arg in zip(mbs, mtp_args):
                total, result = mb_loss(mb, *self._logprobs(mb, mtp_arg))
                total.backward()
                per_mb_stats.append(result)
        self._reduce_gradients()
        return per_mb_stats

    @torch.no_grad()
    def _copy_embedding_to_last_stage(self) -> None:
        """With the MTP head on pipeline stages: the first stage's embedding shard (this TP rank's
        vocabulary rows, as the last optimizer step left them) into the last stage's copy, which
        the head reads detached. Collective over the pipeline group."""
        if not self.mtp_config.enabled:
            return
        if self.stage.first:
            weight = self.module.embedding.word_embeddings.weight.detach()
        else:
            shape = (self.shape.vocab_size // self.config.megatron.tp_size, self.shape.hidden_size)
            if self._mtp_embedding is None or not self.stage.last:
                dtype = next(self.module.parameters()).dtype
                weight = torch.empty(shape, dtype=dtype, device=self.device)
            else:
                weight = self._mtp_embedding
        dist.broadcast(weight, dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        if self.stage.last:
            self._mtp_embedding = weight

    def _reduce_gradients(self) -> None:
        """Sum the per-head q/k norms' partial gradients over TP (each TP rank normalises its own
        heads), then the fp32 gradients over the DP x CP group (each rank's loss covers its own
        tokens), reduce-scattered: each rank receives the slice its masters own (:mod:`.precision`)."""
        if dist.get_world_size(self.tp_group) > 1:
            partial = [self.optimizer.grads(0)[n] for n in self._tp_partial]
            if self.mtp is not None:
                partial += [self.optimizer.grads(1)[n] for n in MTP_TP_PARTIAL]
            all_reduce_flat(partial, self.tp_group)
        self.optimizer.reduce_grads()

    def grad_norm(self, mtp: bool = False) -> float:
        """Global L2 norm of the policy's gradient over TP shards (``mtp``: the MTP head's, one TP
        rank; with pipeline stages the last stage's, on every stage), summed from every DP x CP
        rank's slice. Collective."""
        if not mtp:
            grads = self.optimizer.slice_grads(0).items()
            return sharded_grad_norm(
                grads, self._tp_sharded, self.tp_group, self.device, self.pp_group, slice_group=self.dp_cp_group
            )
        norm = None
        if self.mtp is not None:
            grads = self.optimizer.slice_grads(1).items()
            norm = sharded_grad_norm(grads, MTP_TP_SHARDED, self.tp_group, self.device, slice_group=self.dp_cp_group)
        return from_last_stage(norm, self.pp_group)

    def optimizer_step(self, step: int | None = None, bump_version: bool = True) -> dict[str, float]:
        """Clip (the policy and the MTP head apart), check and apply the gradients to the fp32
        masters, refresh the params (:func:`.precision.optimizer_step`); bumps the version."""
        return optimizer_step(self, step, bump_version)

    # ---- weights -------------------------------------------------------------------------------
    def named_mcore_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under Megatron names (TP shards); the MTP layer's under
        :data:`.mtp.MTP_MODULE`."""
        named = dict(self.module.named_parameters())
        if self.mtp is not None:
            named.update((MTP_MODULE + n, p) for n, p in self.mtp.named_parameters())
        return named

    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full fp32 CPU tensor) for every weight, from the fp32 masters. Collective over
        every rank (masters sharded over DP x CP, shards over TP, layers over pipeline stages). ``mtp.*`` last."""
        yield from convert.gathered_hf_tensors(
            self.optimizer.masters(0), self.shape, self.tp_group, self.pp_group
        )
        if self.mtp_config.enabled:
            yield from self.mtp_hf_tensors(lambda: self.optimizer.masters(1))

    def mtp_hf_tensors(self, named, grads: bool = False):
        """The MTP head's ``mtp.*`` tensors from ``named()`` (its Megatron-named tensors, called on
        the last pipeline stage, which holds the head), on every rank. Collective."""
        return stream_from_last_stage(
            lambda: mtp_mcore_to_hf(named(), self.shape, self.tp_group, grads=grads), self.pp_group, self.device
        )

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """The accumulated fp32 gradients under HF names, full tensors (collective over TP)."""
        out = dict(
            convert.gathered_hf_tensors(self.optimizer.grads(0), self.shape, self.tp_group, self.pp_group, True)
        )
        if self.mtp_config.enabled:
            out.update(self.mtp_hf_tensors(lambda: self.optimizer.grads(1), grads=True))
        return out

    def export_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, kinds: Sequence[str] = ("policy", "mtp")):
        """Weights for the rollout sync in size-bounded buckets, ``(kind, [(name, tensor), ...])``,
        as :meth:`areal_npu.train.fsdp2.FSDPEngine.export_buckets` (:func:`.checkpoint.export_buckets`)."""
        from areal_npu.train.megatron.checkpoint import export_buckets

        yield from export_buckets(self, bucket_bytes, kinds)

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
