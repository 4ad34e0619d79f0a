"""Step time from a plan: per-token costs times the step's tokens, over the devices that do the work.

Three phases, each from one cost (device-seconds per token, or seconds per byte) and the plan:

* **train** (proximal log-probs, forward, backward, optimizer: what the published "training time"
  covers): ``c_train`` device-seconds per token for the whole model. A data-parallel rank packs
  its share of the step's tokens into ``m = ceil(tokens / (dp * mb_tokens))`` micro-batches; one
  micro-batch takes ``mb_tokens * c_train / (tp * cp * pp)`` per pipeline stage and the 1F1B
  schedule runs ``m + pp - 1`` of those: ``T_train = (m + pp - 1) * mb_tokens * c_train / (tp * cp * pp)``.
  Tensor and context parallelism are taken as perfectly efficient (an assumption: their
  communication is not modelled), so at pp 1 the time is ``tokens * c_train / devices``, rounded
  up to whole micro-batches.
* **rollout**: ``c_gen`` device-seconds per episode token decoded autoregressively (prefill of
  prompts and observations included), spread over the engines' devices; engines beyond the
  episodes the controller keeps in flight add nothing. Speculation divides it by the generation
  speed-up ``a`` at the recipe's draft length ``k``.
* **weight sync**: seconds per byte of the compute-dtype weights (with the MTP head) broadcast to
  the engines; it does not change with the node count.

The costs come from the one published timing of this model (:data:`PUBLISHED_RUN`, the seed
"THD Packing & MTP Speculative Decoding Tame 64K Code Agent RL on Ascend NPUs", AReaL-Ascend
v1.0.5): its phase times divided by its work. Its configuration is not published beyond model,
chip, 64K context and MTP drafting; the rest is assumed to be this repository's A3 recipe at its
default 4 nodes (:data:`PUBLISHED_RUN.assumed`; the smallest layout the memory budget accepts: at 2
nodes the trainer does not fit), so fed that configuration the model returns the published times,
and a plan twice its size predicts from there. The phases are added: an upper bound where
``controller.max_staleness >= 1`` overlaps rollout with training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

#: Assumption: a mean episode uses half its token budget. It scales the published run and a plan
#: alike, so it cancels unless the budget changes; the seed publishes no episode lengths.
EPISODE_FILL = 0.5


@dataclass(frozen=True)
class StepConfig:
    """What the step time depends on: the work of one step and the layout that does it."""

    episodes: int  # controller.batch_groups x workflow.group_size
    episode_tokens: int  # the episode's token budget
    mb_tokens: int  # train.packing.max_tokens_per_mb
    weight_bytes: float  # compute-dtype weights sent per sync (with the MTP head)
    dp: int
    tp: int
    cp: int
    pp: int
    engines: int
    engine_tp: int
    in_flight: int  # episodes the controller keeps running at once
    spec_k: int  # 0: no speculation

    @property
    def step_tokens(self) -> float:
        return self.episodes * self.episode_tokens * EPISODE_FILL

    @property
    def micro_batches(self) -> int:
        return math.ceil(self.step_tokens / (self.dp * self.mb_tokens))

    @property
    def train_slots(self) -> float:
        """T_train / c_train: the 1F1B schedule's micro-batch slots times tokens per device."""
        return (self.micro_batches + self.pp - 1) * self.mb_tokens / (self.tp * self.cp * self.pp)

    @property
    def rollout_devices(self) -> int:
        return min(self.engines, self.in_flight) * self.engine_tp


@dataclass(frozen=True)
class PublishedRun:
    """A published run's phase times, the configuration they are taken to come from (``config``;
    what ``assumed`` says was not published), and its generation speed-up at ``config.spec_k``."""

    source: str
    model: str
    shape: tuple[tuple[str, int], ...]  # the ModelDims fields that identify its model
    device: str
    chip: str
    t_gen_s: float
    t_train_s: float
    t_sync_s: float
    config: StepConfig
    gen_speedup: float
    gen_speedup_source: str
    assumed: str

    def costs(self) -> StepCosts:
        ar_gen = self.t_gen_s * self.gen_speedup
        c = self.config
        return StepCosts(
            train_s_per_token=self.t_train_s / c.train_slots,
            gen_s_per_token=ar_gen * c.rollout_devices / c.step_tokens,
            sync_s_per_byte=self.t_sync_s / c.weight_bytes,
            spec_k=c.spec_k,
            gen_speedup=self.gen_speedup,
        )


@dataclass(frozen=True)
class StepCosts:
    """Per-token (per-byte) costs, and the generation speed-up known at draft length ``spec_k``."""

    train_s_per_token: float  # device-seconds per trained token
    gen_s_per_token: float  # device-seconds per rolled-out token, autoregressive
    sync_s_per_byte: float
    spec_k: int
    gen_speedup: float


@dataclass
class StepTime:
    """Seconds per step: autoregressive rollout, the speed-up applied, training, sync."""

    t_gen_ar: float
    gen_speedup: float
    t_train: float
    t_sync: float
    notes: list[str] = field(default_factory=list)

    @property
    def t_gen(self) -> float:
        return self.t_gen_ar / self.gen_speedup

    @property
    def t_step(self) -> float:
        return self.t_gen + self.t_train + self.t_sync


def step_time(config: StepConfig, costs: StepCosts) -> StepTime:
    """The step's phase times for ``config`` from ``costs`` (module docstring)."""
    notes = []
    if config.spec_k == 0:
        speedup = 1.0
    else:
        speedup = costs.gen_speedup
        if config.spec_k != costs.spec_k:
            notes.append(
                f"no speed-up is known at k = {config.spec_k}: the one at k = {costs.spec_k} is used"
            )
    if config.engines > config.in_flight:
        notes.append(
            f"{config.engines - config.in_flight} engine(s) idle: only {config.in_flight} episodes in flight"
        )
    return StepTime(
        t_gen_ar=config.step_tokens * costs.gen_s_per_token / config.rollout_devices,
        gen_speedup=speedup,
        t_train=config.train_slots * costs.train_s_per_token,
        t_sync=config.weight_bytes * costs.sync_s_per_byte,
        notes=notes,
    )


#: The A3 recipe at its default 4 nodes (recipes/code_agent_64k/qwen3_6_27b_a3.yaml): trainer
#: dp 2 x tp 8 x cp 2 on nodes 0-1, 8 engines x tp 4 on nodes 2-3, 8 groups x 8 episodes of 64K
#: tokens, MTP k = 3. Weight bytes:
#: bf16 weights of the shipped config (qwen3_6_27b_config.json) with its MTP layer, 27,320,697,856
#: parameters (ModelDims.num_parameters(with_mtp=True); tests/test_step_cost.py checks it).
_RECIPE_DEFAULT = StepConfig(
    episodes=64, episode_tokens=65536, mb_tokens=65536, weight_bytes=2 * 27_320_697_856,
    dp=2, tp=8, cp=2, pp=1, engines=8, engine_tp=4, in_flight=128, spec_k=3,
)  # fmt: skip

PUBLISHED_RUN = PublishedRun(
    source=(
        "AReaL-Ascend v1.0.5 release post (Qwen3.6-27B, 64K code agent on A3): rollout ~2000 s, "
        "training ~1300 s, weight update ~25 s per step"
    ),
    model="Qwen3.6-27B",
    shape=(("hidden_size", 5120), ("num_layers", 64), ("vocab_size", 248320)),
    device="npu",
    chip="A3",
    t_gen_s=2000.0,
    t_train_s=1300.0,
    t_sync_s=25.0,
    config=_RECIPE_DEFAULT,
    gen_speedup=100.0 / 56.6,
    gen_speedup_source="1.77x at k = 3, the published 8B measurement (EAGLE-3, synchronous RL: 100 -> 56.6 s)",
    assumed=(
        "nodes, layout, batch and episode lengths unpublished: taken as the 4-node A3 recipe (trainer dp 2 x tp 8 "
        "x cp 2, 8 engines x tp 4, 8 x 8 episodes of 64K); its rollouts speculating with MTP k = 3"
    ),
)


def scaled(config: StepConfig, **changes) -> StepConfig:
    """``config`` with fields changed (what-if plans in tests and suggestions)."""
    return replace(config, **changes)
