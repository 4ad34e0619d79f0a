"""Metric keys and step phases: the one definition that every producer and reader imports.

``metrics.jsonl`` holds one JSON object per training step (:mod:`areal_npu.metrics`). Every key
of it is defined here -- written in one place (the controller, the rollout client, the acceptance
tracker, the adaptive-speculation driver, the losses, the train engines, the packer, the planner) and
read in another (the status line, ``areal-npu report``, ``areal-npu plan``, the planner, the driver,
the stats merge), so a rename is one edit. ``tests/test_names.py`` scans the package, ``kernels/``
and ``scripts/`` for a ``<group>/<name>`` literal (or the ``mtp.`` prefix) spelled anywhere else.

Phases. One training step runs :data:`PHASES` one after the other, so ``T_step`` is their sum and
``timing/step_s`` measures it. ``data`` and ``prepare`` (loading and preparing a batch, as NeMo-RL
splits a step) come from the planner's command line; a run of ours logs ``gen`` (waiting for the
batch of rollouts), ``prox`` (recomputing proximal log-probs; NeMo-RL's "logprob" phase), ``train``
and ``sync`` (pushing policy and draft weights to the engines). :data:`SIDE_PHASES` are timed too but
are not part of the sum: ``reward`` is the workflows' time (generation and grading) of the step's
groups, summed over groups that run concurrently with each other and with ``gen``; ``eval`` (held-out
prompts) runs after the step's clock stops.
"""

from __future__ import annotations

PHASES = ("data", "prepare", "gen", "prox", "train", "sync")
SIDE_PHASES = ("reward", "eval")

STEP_TIME = "timing/step_s"  # wall seconds of the whole step (else the sum of PHASES)


def timing_key(phase: str) -> str:
    """``timing/<phase>_s``: seconds spent in ``phase`` during one step."""
    if phase not in PHASES and phase not in SIDE_PHASES:
        raise ValueError(f"phase: {phase!r} is not one of {PHASES + SIDE_PHASES}")
    return f"timing/{phase}_s"


# --- rewards and evaluation (the controller) -----------------------------------------------------
REWARD_MEAN = "reward/mean"
REWARD_MIN = "reward/min"
REWARD_MAX = "reward/max"
REWARD_SOLVED = "reward/solved"  # fraction of trajectories with reward >= 1
REWARD_SUSPICIOUS = "reward/suspicious"  # fraction whose diff adds exit hooks / runner-like output
SUSPICIOUS_STAT = "suspicious"  # the per-episode 0/1 stat (meta["stats"]) REWARD_SUSPICIOUS averages
EVAL_REWARD = "eval/reward"  # held-out prompts, one sample each
EVAL_SOLVED = "eval/solved"
EVAL_FAILED = "eval/failed"  # held-out tasks whose generation or grading failed (left out of the means)


def eval_key(name: str) -> str:
    """A workflow's per-episode number in the held-out eval (``eval/turns``, ``eval/pass_rate``)."""
    return f"eval/{name}"


def episode_key(name: str) -> str:
    """A workflow's per-episode number (``Trajectory.meta["stats"]``), averaged over a step's batch."""
    return f"episode/{name}"


# how a multi-turn episode ended (per-episode 0/1 stats; their step means add up to one)
EPISODE_ENDS = ("submitted", "turn_budget", "token_budget", "format_limit", "env_error")

# a harness episode's new training segments (per-episode counts): compactions -- earlier messages
# rewritten into a shorter prompt -- apart from the other history rewrites (a reply left out, a re-rendering)
SEGMENT_STATS = ("history_rewrites", "compactions")

# which limits held for all of an episode's commands (per-episode 0/1 stats, logged as their step
# means): a control group for each command's process tree (else per-process rlimits), and a size-capped
# area for its repository copy (else a polled quota)
LIMIT_STATS = ("limits_cgroup", "limits_disk_area")

# per-episode latencies (seconds) whose spread matters: the step also logs their 95th percentile
LATENCY_STATS = ("env_start_s", "grade_s")


def episode_p95_key(name: str) -> str:
    """The 95th percentile of a per-episode latency over the step's batch (``episode/env_start_s_p95``)."""
    return f"episode/{name}_p95"


EPISODES_PER_MIN = "episode/per_minute"  # episodes finished per minute of the step's wall time


def env_backend_key(backend: str) -> str:
    """``env/backend_<name>``: the step's episodes that ran on that environment backend."""
    return f"env/backend_{backend}"


ENV_BACKEND_PATTERN = r"env/backend_(.+)"  # env_backend_key's keys; the group is the backend's name


def reward_reason_key(reason: str) -> str:
    """``reward/reason_<reason>``: trajectories of the step graded for that reason."""
    return f"reward/reason_{reason}"


# --- staleness and the rollout side of the loop (the controller) ----------------------------------
STALENESS_MAX = "staleness/max"  # versions between a generated token and the step that trains it
STALENESS_MEAN = "staleness/mean"
STALE_DROPPED_GROUPS = "staleness/dropped_groups"
RESPONSE_LEN = "rollout/response_len"  # mean generated tokens per trajectory
FAILED_GROUPS = "rollout/failed_groups"  # groups dropped by a workflow error, since the start
ENGINE_RESTARTS = "rollout/engine_restarts"  # engines the client restarted (died or unhealthy), since the start
ENGINE_RESYNCS = "rollout/engine_resyncs"  # restarted engines re-streamed the trainer's weights, since the start
VERSION = "rollout/version"  # weight version the engines serve after the step's push

# --- generation throughput (rollout client, acceptance tracker) -----------------------------------
GENERATED_TOKENS = "rollout/generated_tokens"
TOKENS_PER_S = "rollout/tokens_per_s"  # generated tokens per wall second, all engines together
BUSY_S = "rollout/busy_s"  # seconds an engine had work (summed over engines)
TOKENS_PER_BUSY_S = "rollout/tokens_per_busy_s"  # per second an engine had work: what speculation changes
BATCH_SIZE = "rollout/batch_size"  # sequences decoding concurrently (the engine's running batch)

# --- speculative decoding: acceptance (spec.acceptance) and draft length (spec.adaptive) ----------
SPEC_DRAFTS = "rollout/spec_drafts"  # verify steps that carried drafts
SPEC_DRAFT_TOKENS = "rollout/spec_draft_tokens"
SPEC_ACCEPTED_TOKENS = "rollout/spec_accepted_tokens"
SPEC_ACCEPT_RATE = "rollout/spec_accept_rate"  # accepted / drafted tokens
SPEC_MEAN_ACCEPTED_LEN = "rollout/spec_mean_accepted_len"  # 1 + accepted / drafts: tokens per verify step
SPEC_ACCEPT_PER_POS = "rollout/spec_accept_per_pos"  # list u_i, when a run logs the profile as one list
SPEC_ACCEPT_RATE_POS_PATTERN = r"rollout/spec_accept_rate_pos(\d+)"
SPEC_K = "rollout/spec_k"  # draft length the step ran with (0 = speculation off)
SPEC_K_NEXT = "rollout/spec_k_next"  # draft length the adaptive policy chose for the next step


def spec_accept_rate_pos_key(i: int) -> str:
    """``rollout/spec_accept_rate_pos<i>``: ``u_i``, verify steps whose draft ``i + 1`` was accepted / drafts."""
    return f"rollout/spec_accept_rate_pos{int(i)}"


#: per context bucket (``speculation/context.py``: bucket labels such as ``lt4k``, ``4k_16k``)
SPEC_CTX_PATTERN = (
    r"rollout/spec_ctx_([a-z0-9_]+?)_(drafts|accept_rate|mean_accepted_len|accept_rate_pos\d+|k)$"
)


def spec_ctx_key(bucket: str, stat: str) -> str:
    """``rollout/spec_ctx_<bucket>_<stat>``: ``drafts``, ``accept_rate``, ``mean_accepted_len`` or
    ``accept_rate_pos<i>`` of the requests whose context fell in ``bucket``; ``k``: the draft length
    the context-aware policy set for the bucket."""
    return f"rollout/spec_ctx_{bucket}_{stat}"


# --- speculation health (spec.planner.live_perf_metrics) -----------------------------------------
GEN_FRACTION = "perf/gen_fraction"  # T_gen / T_step as measured
STEP_SPEEDUP_BOUND = "perf/step_speedup_bound"
STEP_SPEEDUP_CEILING = "perf/step_speedup_ceiling"

# --- the trainer (algo.ppo, model.mtp_loss, the train engine) -------------------------------------
BEHAVE_IMP_WEIGHT = "ppo/behave_imp_weight"  # prefix: /mean, /min, /max of pi_prox / pi_behave
BEHAVE_IMP_WEIGHT_MEAN = BEHAVE_IMP_WEIGHT + "/mean"
BEHAVE_IMP_WEIGHT_OUTLIER_RATIO = BEHAVE_IMP_WEIGHT + "/outlier_ratio"
BEHAVE_APPROX_KL = "ppo/behave_approx_kl"
VERSION_LAG_MEAN = "ppo/version_lag/mean"
VERSION_LAG_MAX = "ppo/version_lag/max"
PPO_LOSS = "ppo/loss"  # already a fraction of the global normaliser: adds up over micro-batches
PPO_N_VALID_TOKENS = "ppo/n_valid_tokens"  # adds up over micro-batches
PPO_IMPORTANCE_WEIGHT = "ppo/importance_weight"
PPO_CLIP_RATIO = "ppo/clip_ratio"
PPO_DUAL_CLIP_RATIO = "ppo/dual_clip_ratio"
PPO_APPROX_KL = "ppo/approx_kl"
PPO_ENTROPY = "ppo/entropy"
PPO_KL_REF = "ppo/kl_ref"
GRPO_ZERO_ADV_GROUPS = "grpo/zero_adv_groups"  # groups whose rewards are all equal (advantage 0)
GRPO_ZERO_ADV_GROUP_RATIO = "grpo/zero_adv_group_ratio"
GRPO_REWARD_MEAN = "grpo/reward_mean"
GRPO_REWARD_STD_MEAN = "grpo/reward_std_mean"
SFT_NLL = "sft/nll"  # warm start: next-token loss of the policy
SFT_ENTROPY = "sft/entropy"
SFT_LOSS = "sft/loss"  # areal_npu.testing.sft's loop

# --- the train engines (train.base, train.stats): one optimizer step ------------------------------
TRAIN_GRAD_NORM = "train/grad_norm"  # the policy's, before clipping
TRAIN_LR = "train/lr"
TRAIN_VERSION = "train/version"  # weight version after the step
TRAIN_N_TOKENS = "train/n_tokens"  # loss tokens over all data-parallel ranks (summed over mini-batches)

# --- packing (data.packing: packing_stats; the engines add the truncation count) ------------------
PACKING_REAL_TOKENS = "packing/real_tokens"
PACKING_SLOTS = "packing/slots"
PACKING_UTILIZATION = "packing/utilization"
PACKING_CAP_FILL = "packing/cap_fill"
PACKING_PADDED_SLOTS = "packing/padded_slots"
PACKING_PADDED_UTILIZATION = "packing/padded_utilization"
PACKING_ALIGNMENT_PAD_TOKENS = "packing/alignment_pad_tokens"
PACKING_MICRO_BATCHES = "packing/micro_batches"
PACKING_MICRO_BATCHES_LOWER_BOUND = "packing/micro_batches_lower_bound"
PACKING_MICRO_BATCHES_OVER_BOUND = "packing/micro_batches_over_bound"
PACKING_TOKENS_PER_MB_MEAN = "packing/tokens_per_mb_mean"
PACKING_TOKENS_PER_MB_MAX = "packing/tokens_per_mb_max"
PACKING_TOKENS_PER_MB_MIN = "packing/tokens_per_mb_min"
PACKING_SEQUENCES = "packing/sequences"
PACKING_MAX_SEQLEN = "packing/max_seqlen"
PACKING_MEAN_SEQLEN = "packing/mean_seqlen"
PACKING_ATTENTION_COST_RATIO = "packing/attention_cost_ratio"
PACKING_TRUNCATED_SEQUENCES = "packing/truncated_sequences"  # on_too_long=truncate: this rank's cut samples

# --- the MTP head (model.mtp_loss, train.megatron.mtp) ---------------------------------------------
MTP_STATS = "mtp/"  # the group: every mtp/* stat is a fraction of a global count (adds up)
MTP_LOSS = "mtp/loss"  # loss_scale / D * sum_d loss_d
MTP_LOSS_DEPTH_PATTERN = r"mtp/loss_d(\d+)"
MTP_ACC_DEPTH_PATTERN = r"mtp/acc_d(\d+)"


def mtp_loss_key(depth: int) -> str:
    return f"mtp/loss_d{int(depth)}"


def mtp_acc_key(depth: int) -> str:
    return f"mtp/acc_d{int(depth)}"


def mtp_count_key(depth: int) -> str:
    """``mtp/n_d<depth>``: tokens the depth-``depth`` MTP loss was computed on."""
    return f"mtp/n_d{int(depth)}"


MTP_STAT_PREFIXES = ("mtp/loss_d", "mtp/acc_d", "mtp/n_d")

# --- the EAGLE-3 drafter (model.eagle3, train.forward) ---------------------------------------------
EAGLE3_STATS = "eagle3/"  # the group: eagle3/loss, eagle3/loss_d<d>, eagle3/acc_d<d>, eagle3/n_d<d>, as mtp/*
#: Training and export names of the EAGLE-3 drafter's tensors (``eagle3.fc.weight``, ...); the
#: weight stream strips it: the rest is the name vLLM's ``Eagle3LlamaForCausalLM.load_weights`` takes.
EAGLE3_PREFIX = "eagle3."


def as_eagle3_stats(stats: dict[str, float]) -> dict[str, float]:
    """``mtp/*`` stats of :func:`areal_npu.model.mtp_loss.mtp_loss` renamed into the ``eagle3/`` group."""
    return {EAGLE3_STATS + k[len(MTP_STATS) :] if k.startswith(MTP_STATS) else k: v for k, v in stats.items()}


#: Checkpoint and training names of the MTP head's tensors (``mtp.fc.weight``, ...): the trainer,
#: the checkpoint layouts and the rollout's drafter loader all split a state dict on it.
MTP_PREFIX = "mtp."
