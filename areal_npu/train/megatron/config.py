"""What the Megatron-Core engine refuses of the ``train`` section (its layout, ``train.megatron``, is
:class:`areal_npu.train.config.MegatronLayoutConfig`, beside the settings both engines share).

Nothing here imports Megatron.
"""

from __future__ import annotations

from areal_npu.config import ConfigError

__all__ = ["check_loss_layout", "check_megatron_config"]


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
