"""The FSDP2 train engine: packed micro-batches, a loss object (decoupled PPO or SFT) + MTP loss,
bucketed export. It implements :class:`areal_npu.train.protocol.TrainEngine`.

Inputs are token-aligned samples (:class:`areal_npu.data.sample.TrainSample`). What both engines
share -- the cap, packing, the step's counts, loss and stats -- is :class:`areal_npu.train.base.TrainEngineBase`;
here: the sharded model, its forward per micro-batch, the MTP head's targets, the optimizer step, the
export. Checkpoints: :mod:`areal_npu.train.fsdp2_checkpoint`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES, iter_kind_buckets
from areal_npu.data.packed_layout import pack_per_token
from areal_npu.model.eagle3 import Eagle3Config
from areal_npu.model.layout import TEXT, CheckpointLayout
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.mtp_params import apply_mtp_mode, mtp_mode
from areal_npu.model.mtp_targets import build_mtp_targets
from areal_npu.model.packed import enable_packed_attention
from areal_npu.names import EAGLE3_PREFIX, MTP_PREFIX
from areal_npu.platform import current_platform
from areal_npu.train.base import TrainEngineBase, check_export_kinds, optimizer_stats, refuse_non_finite
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import all_reduce_sum
from areal_npu.train.forward import IGNORE, MicroBatch, MTPArgs, PolicyWithMTP
from areal_npu.train.optim import build_optimizer

__all__ = ["FSDPEngine", "enable_activation_checkpointing"]


def enable_activation_checkpointing(lm: nn.Module, mtp: nn.Module | None) -> None:
    """Recompute every decoder layer of the causal LM and of the MTP head in backward (torch's
    non-reentrant checkpoint): only each layer's input is kept between forward and backward.

    transformers checkpoints a layer only while ``layer.training`` is set, and ``from_pretrained``
    returns a model in eval mode, where the option would silently do nothing. The flag is set on
    the layers alone (``.train()`` would recurse and switch on dropout inside them)."""
    import functools

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # It also hooks the embedding output to require grad (for reentrant checkpoints and adapters):
    # not needed non-reentrant, and it would build the frozen backbone's graph in MTP-only mode.
    lm.disable_input_require_grads()
    layers = list(lm.model.layers) + (list(mtp.layers) if mtp is not None else [])
    for layer in layers:
        if not isinstance(layer, GradientCheckpointingLayer):
            raise ValueError(
                f"gradient_checkpointing: {type(layer).__name__} is not a transformers "
                "GradientCheckpointingLayer, so it cannot be recomputed"
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        layer.training = True


class FSDPEngine(TrainEngineBase):
    """Trains a transformers causal LM (+ MTP head) with FSDP2 over the platform's backend.

    ``layout`` is the checkpoint layout the model came from (:func:`areal_npu.model.layout.load_for_training`
    returns the text causal LM of either layout and its layout): exported weights and checkpoints use
    its names, so a published-layout model syncs and saves as ``model.language_model.*``.
    Expects ``torch.distributed`` to be initialised (:func:`areal_npu.train.dist.init_distributed`);
    every rank calls every method with its own share of the batch.
    """

    def __init__(
        self,
        lm: nn.Module,
        mtp: nn.Module | None,
        config: TrainEngineConfig,
        mtp_config: MTPConfig | None = None,
        pad_token_id: int = 0,
        layout: CheckpointLayout | None = None,
        reader=None,
        eagle3: nn.Module | None = None,
        eagle3_config: Eagle3Config | None = None,
    ):
        """``mtp_config``: a validated config (the recipe's ``mtp``); default the head as given.
        ``reader``: ``lm`` is on the meta device and each rank reads its shards from this
        :class:`~areal_npu.model.safetensors_reader.SafetensorsReader` (:meth:`from_checkpoint`).
        ``eagle3``: an :class:`~areal_npu.model.eagle3.Eagle3Drafter` trained beside the policy
        (``eagle3_config``: its loss and learning-rate scales, depths); exported as ``eagle3.*``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        config.validate()
        if config.backend != "fsdp2":
            raise ValueError(f"the FSDP2 engine got a train config for backend {config.backend!r}")
        if not hasattr(getattr(lm, "model", None), "layers"):
            raise ValueError(
                f"{type(lm).__name__} is not a text causal LM (no .model.layers): load a published "
                "(multimodal) checkpoint with areal_npu.model.layout.load_for_training, which trains its language model"
            )
        self.layout = layout or CheckpointLayout(TEXT)
        self.config = config
        self.mtp_config = mtp_config or MTPConfig(enabled=mtp is not None, train=mtp is not None)
        self.eagle3_config = eagle3_config or Eagle3Config(enabled=eagle3 is not None)
        self.pad_token_id = pad_token_id
        self.platform = current_platform()
        self.device = self.platform.current_device()
        self.version = 0  # weight version: optimizer steps taken
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (areal_npu.train.dist.init_distributed)")

        if self.mtp_config.enabled and mtp is None:
            raise ValueError("mtp.enabled but no MTP head was given (load one or set mtp.init_new_head)")
        mtp = mtp if self.mtp_config.enabled else None
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.compute_dtype = dtype
        enable_packed_attention(lm)
        if config.gradient_checkpointing:
            enable_activation_checkpointing(lm, mtp)
        groups = apply_mtp_mode(lm, mtp, self.mtp_config)
        # fp32 master weights whatever the compute dtype (a model loaded in bf16 is upcast): the
        # optimizer then keeps fp32 states and applies updates below bf16's resolution, which a
        # bf16 parameter would round away. FSDP2 all-gathers bf16 copies for the compute
        # (param_dtype) and reduces gradients in fp32 into the fp32 shards.
        if reader is None:
            self.module = PolicyWithMTP(lm, mtp, eagle3).to(device=self.device, dtype=torch.float32)
        else:  # the policy stays on the meta device until it is sharded (materialise)
            self.module = PolicyWithMTP(lm.to(dtype=torch.float32), mtp, eagle3)
            for head in (mtp, eagle3):
                if head is not None:
                    head.to(device=self.device, dtype=torch.float32)
        named = self.module.named_parameters() if reader is not None else ()  # the new MTP head's
        kept = {n: p.detach().clone() for n, p in named if not p.is_meta}
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in list(lm.model.layers) + (list(mtp.layers) if mtp is not None else []):
            fully_shard(layer, mp_policy=policy)
        fully_shard(self.module, mp_policy=policy)
        if reader is not None:  # each rank's rows of each parameter, read into its shard
            from areal_npu.train.fsdp2_stream import materialise

            materialise(self.module, reader, self.layout, kept, self.device)
        del kept
        self.lm, self.mtp, self.eagle3 = self.module.lm, self.module.mtp, self.module.eagle3
        # fully_shard swaps parameters for DTensors in place: collect them after sharding, by name.
        trainable = {("lm." + n) for n, _ in groups.policy} | {n for n, _ in groups.mtp}
        named = dict(self.module.named_parameters())
        drafter = sorted(n for n in named if n.startswith(EAGLE3_PREFIX))
        param_groups = [  # one group per part: clipped apart (optimizer_step), so none rescales another
            {"params": [named[n] for n in sorted(trainable) if not n.startswith(MTP_PREFIX)]},
            {
                "params": [named[n] for n in sorted(trainable) if n.startswith(MTP_PREFIX)],
                "lr": config.optim.lr * groups.mtp_lr_scale,
            },
            {"params": [named[n] for n in drafter], "lr": config.optim.lr * self.eagle3_config.lr_scale},
        ]
        self.optimizer, self.scheduler = build_optimizer(
            [g for g in param_groups if g["params"]], config.optim
        )

    @classmethod
    def from_checkpoint(
        cls, model_dir, config: TrainEngineConfig, mtp_config: MTPConfig, **kwargs
    ) -> FSDPEngine:
        """From an HF checkpoint directory (either layout): the model built on the meta device,
        sharded, then each rank's rows read from the checkpoint (:mod:`.fsdp2_stream`); the MTP
        head (one layer) is read whole."""
        from areal_npu.model.layout import PUBLISHED, config_and_layout
        from areal_npu.model.mtp_checkpoint import build_mtp_head
        from areal_npu.model.safetensors_reader import SafetensorsReader
        from areal_npu.train.fsdp2_stream import meta_text_model

        hf_config, layout = config_and_layout(model_dir)
        lm = meta_text_model(hf_config)
        if layout.kind == PUBLISHED:  # one config object: what training sets on it is saved
            layout.config.text_config = lm.config
        head = build_mtp_head(lm.config, mtp_config, model_dir) if mtp_config.enabled else None
        return cls(lm, head, config, mtp_config, layout=layout, reader=SafetensorsReader(model_dir), **kwargs)

    # ---- the steps the base leaves to the engine -------------------------------------------------
    def _to_device(self, packed, fields) -> MicroBatch:
        return MicroBatch.on(packed, fields, self.device)

    def _loss_cu_seqlens(self, mb: MicroBatch) -> torch.Tensor:
        return mb.cu_seqlens

    def _packed_logprobs(self, mbs: list[MicroBatch]):
        for mb in mbs:
            logp, _, _, _ = self.module(mb, self.config.logprob_chunk_size, self.config.temperature, None)
            yield mb.packed, logp.float().cpu()

    def _mtp_args(self, plan, mbs: list[MicroBatch], samples) -> list[tuple[MTPArgs | None, MTPArgs | None]]:
        """Per micro-batch the MTP head's and the EAGLE-3 drafter's targets (from its samples'
        token-aligned loss masks) with the global per-depth counts; None for one that does not train."""
        trains = self.mtp is not None and mtp_mode(self.mtp_config) in ("joint", "mtp_only")
        mtp = self._draft_args(
            plan, mbs, samples, self.mtp_config.num_depths, self.mtp_config.loss_scale, trains
        )
        cfg = self.eagle3_config
        eagle3 = self._draft_args(plan, mbs, samples, cfg.num_depths, cfg.loss_scale, self.eagle3 is not None)
        return list(zip(mtp, eagle3, strict=True))

    def _draft_args(self, plan, mbs, samples, depths: int, loss_scale: float, trains: bool) -> list:
        if not trains:
            return [None] * len(mbs)
        args = [
            self._mtp_targets(mb, [samples[i].loss_mask for i in indices], depths, loss_scale)
            for indices, mb in zip(plan, mbs)
        ]
        local = [sum(a.targets.valid_counts()[d] for a in args) for d in range(depths)]
        counts = [int(c) for c in all_reduce_sum([float(c) for c in local])]
        for a in args:
            a.counts = counts
        return args

    def _mtp_targets(
        self, mb: MicroBatch, token_masks: list[torch.Tensor], depths: int, loss_scale: float
    ) -> MTPArgs:
        packed = mb.packed
        # token-aligned loss mask over prompt + response ids, as the policy's (packed without shift)
        mask = pack_per_token([s.to(torch.bool) for s in token_masks], packed, False)
        targets = build_mtp_targets(
            packed.input_ids,
            depths,
            packed.cu_seqlens,
            mask,
            packed.valid_mask,
            self.pad_token_id,
            IGNORE,
        )
        targets.embed_ids, targets.labels = targets.embed_ids.to(self.device), targets.labels.to(self.device)
        return MTPArgs(targets, loss_scale)

    def _accumulate(self, mbs: list[MicroBatch], mtp_args, mb_loss) -> list:
        world = dist.get_world_size()
        self.optimizer.zero_grad(set_to_none=True)
        per_mb_stats = []
        for i, mb in enumerate(mbs):
            self.module.set_requires_gradient_sync(i == len(mbs) - 1)
            logp, entropy, aux, aux_stats = self.module(
                mb, self.config.logprob_chunk_size, self.config.temperature, *mtp_args[i]
            )
            total, result = mb_loss(mb, logp, entropy, aux, aux_stats)
            # FSDP averages gradients over ranks; the loss is already a global mean, so undo that.
            (total * world).backward()
            per_mb_stats.append(result)
        self.module.set_requires_gradient_sync(True)
        return per_mb_stats

    def optimizer_step(self, step: int | None = None, bump_version: bool = True) -> dict[str, float]:
        """Clip, check and apply the accumulated gradients; bumps the weight version."""
        step = self.version if step is None else step
        clip = self.config.optim.grad_clip
        # Clipped per group (policy, MTP head): a joint clip would let the head's gradient rescale
        # the policy's update, breaking the head's isolation from the backbone.
        norms = []
        for group in self.optimizer.param_groups:
            norm = torch.nn.utils.clip_grad_norm_(group["params"], clip if clip > 0 else float("inf"))
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        refuse_non_finite(norms, step, lambda: self.optimizer.zero_grad(set_to_none=True))
        self.optimizer.step()
        self.scheduler.step()
        if bump_version:
            self.version += 1
        return optimizer_stats(norms[0], self.scheduler.get_last_lr()[0], self.version)

    # ---- weights --------------------------------------------------------------------------------
    def full_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(training name, full CPU tensor) for every parameter: the text causal LM's names
        (``model.*``, ``lm_head.*``) and ``mtp.*``; ``self.layout.checkpoint_name`` gives the
        checkpoint's. Collective: all ranks iterate."""
        for name, param in self.module.state_dict().items():
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            if name.startswith("lm."):
                yield name[len("lm.") :], tensor.detach().cpu()
            elif name.startswith(MTP_PREFIX) and not name.startswith(MTP_PREFIX + "rotary_emb"):
                yield name, tensor.detach().cpu()

    def eagle3_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(eagle3.<vLLM name>, full CPU tensor)`` of the EAGLE-3 drafter (none without one). Collective."""
        for name, param in self.module.state_dict().items():
            if name.startswith(EAGLE3_PREFIX):
                tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
                yield name, tensor.detach().cpu()

    def export_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, kinds: Sequence[str] = ("policy", "mtp")):
        """Weights for the rollout sync in size-bounded buckets: ``(kind, [(name, tensor), ...])``,
        under the names of the checkpoint's layout (what the engine's ``load_weights`` takes), in
        the compute dtype (``config.dtype``; :meth:`full_state_dict` gives the fp32 masters).

        ``kind`` is ``policy``, ``mtp`` or ``eagle3`` (vLLM loads a drafter separately), or ``vision`` (a
        published checkpoint's untouched vision tower; only when asked: vLLM serving with images
        off builds no vision tower to load it into). Frozen parts are skipped
        (a frozen head was loaded once by the engine). With an EAGLE-3 drafter, ``mtp`` (the engines'
        drafter) gives its ``eagle3.*`` and not the MTP head's ``mtp.*``. Collective: every rank iterates.
        """
        check_export_kinds(kinds)
        mode = mtp_mode(self.mtp_config)
        wanted = {
            "policy": mode != "mtp_only" and "policy" in kinds,
            "mtp": mode in ("joint", "mtp_only") and "mtp" in kinds,
            "vision": "vision" in kinds,
            # ``mtp`` asks for the engines' drafter: with an EAGLE-3 drafter here the engines draft with
            # it (the recipe: eagle3.enabled needs rollout.spec.method eagle3), and the MTP head, which
            # still trains, is not sent (its mtp.* would reach the EAGLE-3 module)
            "eagle3": self.eagle3 is not None and ("eagle3" in kinds or "mtp" in kinds),
        }
        wanted["mtp"] = wanted["mtp"] and self.eagle3 is None
        carried = (("vision", n, t) for n, t in self.layout.carried.items())
        drafter = (("eagle3", n, t.to(self.compute_dtype)) for n, t in self.eagle3_state_dict())
        # The compute dtype's copy of the fp32 masters: the weights the trainer's forward uses, at
        # half the bytes per sync for bf16 (checkpoints keep the fp32 masters).
        named = (
            (
                "mtp" if n.startswith(MTP_PREFIX) else "policy",
                self.layout.checkpoint_name(n),
                t.to(self.compute_dtype) if t.is_floating_point() else t,
            )
            for n, t in self.full_state_dict()
        )
        # the filter still draws every tensor: full_state_dict is collective, every rank iterates it all
        kept = ((k, n, t) for k, n, t in itertools.chain(named, carried, drafter) if wanted[k])
        yield from iter_kind_buckets(kept, bucket_bytes)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(
        self, root: str | Path, extra: dict | None = None, tokenizer=None, keep_last: int = 2
    ) -> Path:
        """``<root>/step_<version>``, atomic (:mod:`areal_npu.train.fsdp2_checkpoint`). Collective."""
        from areal_npu.train.fsdp2_checkpoint import save_checkpoint

        return save_checkpoint(self, root, extra, tokenizer, keep_last)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore a checkpoint of :meth:`save_checkpoint`; returns the caller's ``extra``. Collective."""
        from areal_npu.train.fsdp2_checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def save_hf_checkpoint(self, out_dir: str | Path, tokenizer=None) -> Path:
        """The weights as a Hugging Face checkpoint (with ``mtp.*``) in the model's layout. Collective."""
        from areal_npu.train.fsdp2_checkpoint import write_hf_checkpoint

        return write_hf_checkpoint(self, out_dir, tokenizer)
