"""The Megatron-Core engine's part of the ``train`` section: its parallel layout (``train.megatron``)
and what it refuses of the shared settings (:class:`areal_npu.train.config.TrainEngineConfig`).

Nothing here imports Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_npu.config import ConfigError

__all__ = ["MegatronLayoutConfig", "check_megatron_config"]


@dataclass
class MegatronLayoutConfig:
    """The Megatron-Core engine's parallel layout (``train.backend: megatron``); world = dp * tp * cp * pp."""

    tp_size: int = 1  # tensor-parallel ranks: attention heads, FFN and vocabulary sharded over them
    cp_size: int = 1  # context-parallel ranks: every packed sequence split zigzag over them
    pp_size: int = 1  # pipeline stages: decoder layers split evenly over them (1F1B schedule)
    sequence_parallel: bool = (
        False  # activations outside attention/FFN sharded over TP (needs tp_size >= 2, cp_size 1)
    )

    def validate(self) -> None:
        for key in ("tp_size", "cp_size", "pp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be an int >= 1, got {value!r}")


def check_megatron_config(train) -> None:
    """What the Megatron engine refuses of a ``train`` config (keys relative to ``train``)."""
    layout = train.megatron
    if layout.sequence_parallel and layout.tp_size < 2:
        raise ConfigError(
            "megatron.sequence_parallel", "shards activations over TP ranks: needs tp_size >= 2"
        )


def check_loss_layout(loss, cp_size: int) -> None:
    """Refuse a loss this layout cannot compute: one that reduces over whole sequences (a seq-mean,
    a sequence-level importance weight) under context parallelism, where each rank holds a zigzag
    share of every sequence."""
    if loss.needs_whole_sequences and cp_size > 1:
        key = loss.whole_sequence_key() if hasattr(loss, "whole_sequence_key") else "train.megatron.cp_size"
        raise ConfigError(
            key,
            f"{loss!r} needs whole sequences (a seq-mean or a sequence-level weight), but with "
            f"train.megatron.cp_size={cp_size} each rank holds a share of every sequence; use token-mean "
            "and token-level weights, or cp_size 1",
        )
