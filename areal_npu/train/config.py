"""The recipe's ``train`` section: which engine trains (``backend``), the trainer's layout, and the
settings both engines share. Both take it: the FSDP2 engine (:mod:`areal_npu.train.fsdp2`) and the
Megatron-Core engine (:mod:`areal_npu.train.megatron.engine`); :func:`areal_npu.train.factory.build_engine`
builds the one ``backend`` names.

One derivation: ``packing.tp_size`` / ``cp_size`` (how micro-batches are padded and split) follow
the layout, ``train.megatron.tp_size`` / ``cp_size``; the FSDP2 engine has neither parallelism.
Validation here is what any plan needs (``train --dry-run`` plans for other machines); what the
chosen engine cannot do here is refused by :func:`areal_npu.train.factory.check_trainer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_npu.config import ConfigError
from areal_npu.data.packing import PackingConfig
from areal_npu.train.optim import OptimConfig

__all__ = ["BACKENDS", "MegatronLayoutConfig", "TrainEngineConfig"]

BACKENDS = ("fsdp2", "megatron")


@dataclass
class MegatronLayoutConfig:
    """The Megatron-Core engine's parallel layout (``train.backend: megatron``); world = dp * tp * cp * pp."""

    tp_size: int = 1  # tensor-parallel ranks: attention heads, FFN and vocabulary sharded over them
    cp_size: int = 1  # context-parallel ranks: every packed sequence split zigzag over them
    pp_size: int = 1  # pipeline stages: decoder layers split evenly over them (1F1B schedule)
    sequence_parallel: bool = (
        False  # activations outside attention/FFN sharded over TP (needs tp_size >= 2)
    )

    def validate(self) -> None:
        for key in ("tp_size", "cp_size", "pp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be an int >= 1, got {value!r}")



@dataclass
class TrainEngineConfig:
    backend: str = (
        "fsdp2"  # fsdp2 | megatron (Megatron-Core: tensor/context parallelism; Qwen3 dense off the NPU)
    )
    dp_size: int = 1  # data-parallel trainer ranks (with megatron each a tp x cp group); areal-npu train starts tp x cp x dp processes through torchrun
    # Compute dtype: float32 | bfloat16. Parameters, gradients and optimizer states are float32
    # either way (fp32 master weights); bfloat16 is the forward/backward copy FSDP2 casts at unshard
    # (Megatron: bf16 params refreshed after each step from fp32 masters sharded over DP x CP).
    dtype: str = "float32"
    logprob_chunk_size: int = 2048  # tokens per chunk of the [T, V] log-prob computation
    temperature: float = 1.0  # scores log_softmax(z / temperature); = workflow.temperature (recipe.py)
    gradient_checkpointing: bool = False  # recompute each decoder layer (policy and MTP head) in backward
    ppo_minibatches: int = 1  # optimizer steps per train step (PPO mini-batches); the version bumps once
    # train --dry-run refuses (exit 2) a plan whose memory budget per trainer device (step peak, runtime and HCCL
    # reserve, fragmentation) is above this fraction of the device's memory; in (0, 1]
    max_memory_fraction: float = 0.85
    optim: OptimConfig = field(default_factory=OptimConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    megatron: MegatronLayoutConfig = field(default_factory=MegatronLayoutConfig)

    def pre_validate(self) -> None:
        """The backend, and ``packing.tp_size`` / ``cp_size`` derived from its layout, before
        ``packing`` validates against them."""
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.backend == "fsdp2":
            layout = self.megatron
            for key in ("tp_size", "cp_size", "pp_size", "sequence_parallel"):
                if getattr(layout, key) != getattr(MegatronLayoutConfig, key):
                    raise ConfigError(
                        f"megatron.{key}", f"is set ({getattr(layout, key)}) but train.backend is fsdp2; "
                        "set train.backend=megatron for tensor/context/pipeline parallelism",
                    )  # fmt: skip
            derived = {"tp_size": 1, "cp_size": 1}
        else:
            derived = {"tp_size": self.megatron.tp_size, "cp_size": self.megatron.cp_size}
        for key, value in derived.items():
            given = getattr(self.packing, key)
            if given not in (1, value):
                kind = "tensor" if key == "tp_size" else "context"
                raise ConfigError(
                    f"packing.{key}",
                    f"must be 1 (got {given}): the FSDP2 engine has no {kind} parallelism; set train.backend=megatron "
                    f"and train.megatron.{key}" if self.backend == "fsdp2" else
                    f"follows train.megatron.{key} ({value}), got {given}; set train.megatron.{key} only",
                )  # fmt: skip
            setattr(self.packing, key, value)

    def validate(self) -> None:
        self.pre_validate()  # also when an engine checks its config directly
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ConfigError("dp_size", f"must be an int >= 1, got {self.dp_size!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.logprob_chunk_size < 1:
            raise ValueError("logprob_chunk_size must be >= 1")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        if self.ppo_minibatches < 1:
            raise ValueError("ppo_minibatches must be >= 1")
        if isinstance(self.max_memory_fraction, bool) or not 0 < self.max_memory_fraction <= 1:
            raise ConfigError("max_memory_fraction", f"must lie in (0, 1]; got {self.max_memory_fraction!r}")
        self.packing.validate()
        self.megatron.validate()
        packing = self.packing
        forced = self.dp_size > 1 or packing.min_mbs > 1 or packing.mbs_divisor > 1
        if not forced and packing.cost_linear_coef != PackingConfig.cost_linear_coef:
            raise ConfigError("packing.cost_linear_coef", "balances micro-batches only when their count is forced "
                              "above the plan's own (train.dp_size > 1, packing.min_mbs > 1 or packing.mbs_divisor "
                              f"> 1); none is here: remove it or set it back to {PackingConfig.cost_linear_coef}")  # fmt: skip
