"""Configuration of the Megatron-Core train engine.

The fields shared with the FSDP2 engine (:class:`areal_npu.train.engine.TrainEngineConfig`) have the
same names and meanings; the parallel layout is added. ``packing.tp_size`` / ``packing.cp_size``
lay the micro-batches out for the layout, so they must equal ``tp_size`` / ``cp_size`` (a mismatch is
refused rather than silently corrected: the recipe says one thing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_npu.config import ConfigError
from areal_npu.data.packing import PackingConfig
from areal_npu.train.optim import OptimConfig

__all__ = ["MegatronEngineConfig"]


@dataclass
class MegatronEngineConfig:
    dtype: str = "float32"  # float32 only for now (bf16 needs fp32 master weights: not wired yet)
    logprob_chunk_size: int = 2048  # tokens per chunk of the [t, V/tp] log-prob computation
    temperature: float = 1.0  # must match the behaviour log-probs (vLLM raw log-probs: 1.0)
    gradient_checkpointing: bool = False  # Megatron recompute: refused on the CPU (CUDA RNG states)
    ppo_minibatches: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    packing: PackingConfig = field(default_factory=lambda: PackingConfig(max_tokens_per_mb=8192))
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False

    def validate(self, device_type: str = "cpu") -> MegatronEngineConfig:
        for key in ("tp_size", "cp_size", "pp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be an int >= 1, got {value!r}")
        if self.pp_size != 1:
            raise ConfigError("pp_size", f"pipeline parallelism is not wired yet (got {self.pp_size}); use 1")
        if self.packing.tp_size != self.tp_size or self.packing.cp_size != self.cp_size:
            raise ConfigError(
                "packing.tp_size",
                f"packing lays micro-batches out for tp={self.packing.tp_size}, cp={self.packing.cp_size} but the "
                f"engine runs tp={self.tp_size}, cp={self.cp_size}; set them equal",
            )
        self.packing.validate()
        if self.dtype != "float32":
            raise ConfigError(
                "dtype", f"the Megatron engine trains in float32 only so far (got {self.dtype!r}): bf16 needs "
                "fp32 master weights (Megatron's DistributedOptimizer), not wired yet",
            )  # fmt: skip
        if self.sequence_parallel:
            # Megatron's local spec norms refuse it, and over gloo it would need reduce-scatter.
            raise ConfigError(
                "sequence_parallel",
                "needs Transformer Engine / MindSpeed norms and a reduce-scatter; not wired",
            )
        if self.gradient_checkpointing and device_type == "cpu":
            raise ConfigError(
                "gradient_checkpointing",
                "Megatron's recomputation saves CUDA RNG states; not available on the CPU",
            )
        if self.gradient_checkpointing:
            raise ConfigError("gradient_checkpointing", "not wired into the Megatron engine yet")
        if self.logprob_chunk_size < 1:
            raise ConfigError("logprob_chunk_size", "must be >= 1")
        if not self.temperature > 0:
            raise ConfigError("temperature", "must be > 0")
        if self.ppo_minibatches < 1:
            raise ConfigError("ppo_minibatches", "must be >= 1")
        return self
