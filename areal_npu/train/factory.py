"""The one place a train engine is chosen and built: ``train.backend`` -> the FSDP2 or the
Megatron-Core engine, from a Hugging Face checkpoint; and what the chosen engine cannot do with a
recipe, refused before any work (:func:`check_trainer`, :func:`check_world_size`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

from areal_npu.config import ConfigError
from areal_npu.model.mtp import MTPConfig
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.protocol import TrainEngine

__all__ = ["build_engine", "check_megatron_layout", "check_trainer", "check_world_size"]


def build_engine(
    train: TrainEngineConfig,
    checkpoint: str | Path,
    mtp: MTPConfig,
    pad_token_id: int,
    eagle3=None,
    eagle3_config=None,
) -> TrainEngine:
    """The engine ``train.backend`` names, holding the weights of the HF checkpoint ``checkpoint``
    (and its ``mtp.*`` head where ``mtp`` asks for one; ``eagle3``: an EAGLE-3 drafter to train
    beside it, FSDP2 only). Needs ``torch.distributed`` initialised."""
    if train.backend == "fsdp2":
        from areal_npu.train.fsdp2 import FSDPEngine

        # built on the meta device; each rank reads only its rows of the checkpoint
        return FSDPEngine.from_checkpoint(
            checkpoint, train, mtp, pad_token_id=pad_token_id, eagle3=eagle3, eagle3_config=eagle3_config
        )
    if eagle3 is not None:
        raise ConfigError("eagle3.enabled", f"trains in the FSDP2 engine only, not {train.backend!r}")
    if train.backend == "megatron":
        from areal_npu.train.megatron.engine import MegatronEngine
        from areal_npu.train.megatron.mtp import check_mtp

        check_mtp(mtp)  # before loading anything
        # either layout (the text LM trains); each rank reads only its shards of the checkpoint
        return MegatronEngine.from_checkpoint(checkpoint, train, mtp, pad_token_id=pad_token_id)
    raise ConfigError("train.backend", f"no engine for {train.backend!r}")


def _model_hf_config(model):
    """The HF config of the recipe's model: its checkpoint's, or the tiny model's."""
    if model.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(Path(model.path).expanduser())
    from areal_npu.model.tiny import hf_config

    return hf_config(model.tiny)


def _prefixed(exc: ConfigError, prefix: str) -> ConfigError:
    return ConfigError(prefix + exc.key, str(exc)[len(exc.key) + 2 :])


def check_trainer(cfg, with_model: bool = True) -> None:
    """What the run's train engine cannot do with the recipe ``cfg`` (an ``RLConfig``), as a
    :class:`ConfigError` naming the key: a batch the trainer ranks cannot share, the loss, and for
    ``train.backend: megatron`` everything its engine refuses (layout, dtype, MTP, the model, the
    divisibility of heads / KV heads / FFN / vocabulary by TP and of layers by PP).
    ``with_model=False`` (a plan for other machines, the checkpoint maybe absent): all but the
    model's own checks (what it is, and how its heads and layers divide)."""
    train = cfg.train
    _check_ranks(cfg)
    if train.backend != "megatron":
        _check_loss(cfg)
        return
    check_megatron_layout(cfg, train.megatron.tp_size, train.megatron.cp_size, train.megatron.pp_size)
    if not with_model:
        return
    from areal_npu.train.megatron.model import check_layout, check_supported

    hf = _model_hf_config(cfg.model)
    try:
        check_supported(hf, cfg.device)
    except NotImplementedError as exc:
        raise ConfigError("train.backend", f"the Megatron engine cannot build this model: {exc}") from None
    layout = train.megatron
    try:
        check_layout(hf, layout.tp_size, layout.pp_size, layout.cp_size, layout.sequence_parallel)
    except ValueError as exc:
        text = str(exc)
        key = next((f"train.megatron.{k}" for k in ("pp_size", "cp_size", "sequence_parallel") if k in text),
                   "train.megatron.tp_size")  # fmt: skip
        raise ConfigError(key, str(exc)) from None


def _check_loss(cfg):
    from areal_npu.train.losses import PPOLoss

    return PPOLoss(cfg.ppo)  # refuses what no engine computes (ppo.kl_coef)


def check_megatron_layout(cfg, tp_size: int, cp_size: int, pp_size: int) -> None:
    """What the Megatron engine refuses of the recipe ``cfg`` at tp / cp / pp sizes (the recipe's, or
    a layout a plan considers), the model aside: its settings, the MTP head (depth 1, trained
    jointly), a loss that needs whole sequences under context parallelism. A :class:`ConfigError`."""
    from areal_npu.train.megatron.config import check_loss_layout, check_megatron_config
    from areal_npu.train.megatron.mtp import check_mtp

    loss = _check_loss(cfg)
    sizes = dict(tp_size=tp_size, cp_size=cp_size, pp_size=pp_size)
    train = SimpleNamespace(megatron=dataclasses.replace(cfg.train.megatron, **sizes))
    try:
        check_megatron_config(train)
    except ConfigError as exc:
        raise _prefixed(exc, "train.") from None
    check_mtp(cfg.mtp)
    check_loss_layout(loss, cp_size)


def _check_ranks(cfg) -> None:
    """Data-parallel ranks (``train.dp_size``; with Megatron each one a TP x CP group whose ranks get
    the same samples): each an equal share of every PPO mini-batch
    (:func:`areal_npu.train.ranks.shard_indices`). Megatron's tp/cp layout is checked against the
    processes at the start (:func:`check_world_size`), its sizes by :func:`check_trainer`."""
    train = cfg.train
    if train.dp_size == 1:
        return
    batch = cfg.controller.batch_groups * cfg.workflow.group_size
    if batch % (train.dp_size * train.ppo_minibatches):
        raise ConfigError(
            "train.dp_size",
            f"{train.dp_size} ranks x {train.ppo_minibatches} PPO mini-batch(es) do not split a batch of "
            f"{batch} trajectories (controller.batch_groups x workflow.group_size) evenly",
        )


def check_world_size(train: TrainEngineConfig, world_size: int) -> None:
    """The layout's ranks (dp x tp x pp x cp) against the trainer processes there are."""
    from areal_npu.placement import TrainerLayout

    layout = TrainerLayout.of(train)
    if layout.world_size != world_size:
        raise ConfigError(
            layout.size_key(),
            f"the trainer layout needs {layout.describe()} ranks, but this run has {world_size} trainer "
            f"process(es): start one per rank, `torchrun --nproc-per-node {layout.world_size} -m areal_npu.cli "
            "train RECIPE ...`",
        )
