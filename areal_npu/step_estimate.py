"""What ``areal-npu train RECIPE --dry-run`` prints beside the placement plan: the trainer's peak
memory per device and a step-time prediction. Both are estimates for machines the dry run does not
run on; nothing here allocates a device or starts a process.

* **Memory**: :func:`areal_npu.memory_model.estimate_step_memory` for one trainer rank of the
  planned layout (dp / tp / cp / pp from the plan, the recipe's ``train.backend``), one packed
  micro-batch of ``train.packing.max_tokens_per_mb`` tokens, the recipe's compute dtype, activation
  checkpointing, log-prob chunk and trained MTP depths, against the device's memory
  (:data:`DEVICE_MEMORY_BYTES`). One packed segment per micro-batch is assumed (each extra
  segment adds at most 63 tokens of Gated DeltaNet chunk padding). The rollout engines are not
  estimated: vLLM sizes its KV cache to ``rollout.gpu_memory_utilization`` of each device.
* **Model shape**: a config file given with ``--model-config`` (the 64K recipes' scripts pass the
  shipped one where the checkpoint is absent), else ``model.path``'s ``config.json``, else the tiny
  model of ``model.tiny`` when ``model.path`` is empty.
* **Step time**: ``areal-npu plan``'s step model (:func:`areal_npu.speculation.step_plan.plan_from_numbers`)
  fed with published figures (:data:`PUBLISHED_STEP`, :data:`PUBLISHED_SPEC_SPEEDUP`) when they
  describe this model on this kind of device; otherwise no prediction, and a note says so.

``areal-npu plan --memory RECIPE`` prints the memory part alone, at the recipe's own layout
(:func:`recipe_memory_report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_npu.config import ConfigError
from areal_npu.memory_model import GIB, MemoryEstimate, ModelDims, ParallelLayout, estimate_step_memory

#: Memory of one device: an Ascend A2 (910B) NPU and one A3 (910C) die each have 64 GB of HBM.
#: Other kinds differ from machine to machine: no verdict is printed for them.
DEVICE_MEMORY_BYTES = {"npu": 64 * GIB}
#: Devices per node that identify the Ascend chip of a described NPU cluster.
ASCEND_CHIPS = {8: "A2", 16: "A3"}


@dataclass(frozen=True)
class PublishedStep:
    """Per-step phase times of a published RL run and what is known of its scale. ``shape``: the
    :class:`ModelDims` fields that identify its model; the times apply to a recipe whose model
    has them, on ``device`` (chip ``chip``). The run's device counts are ``None`` where they were
    not published; with both given, the times scale to a plan's device counts (linearly)."""

    source: str
    model: str
    shape: tuple[tuple[str, int], ...]
    device: str
    chip: str
    t_gen_s: float
    t_train_s: float
    t_sync_s: float
    rollout_devices: int | None = None
    trainer_devices: int | None = None

    def matches(self, dims: ModelDims) -> bool:
        values = {"num_layers": dims.num_layers, **dataclasses.asdict(dims)}
        return all(values.get(name) == value for name, value in self.shape)


@dataclass(frozen=True)
class PublishedSpeedup:
    """A published generation speed-up from speculative decoding at draft length ``k``."""

    source: str
    k: int
    gen_speedup: float  # generation time without / with speculation
    step_speedup: float  # the step's, as measured in the same study


PUBLISHED_STEP = PublishedStep(
    source=(
        "a published 64K-token code-agent RL run of Qwen3.6-27B on Ascend A3 (reward 0.56 -> 0.94 in ~120 "
        "steps, behave_imp_weight ~0.9995): per step rollout ~2000 s, training ~1300 s, weight update ~25 s; "
        "its node count, batch and whether its rollouts speculated are not stated"
    ),
    model="Qwen3.6-27B",
    shape=(("hidden_size", 5120), ("num_layers", 64), ("vocab_size", 248320)),
    device="npu",
    chip="A3",
    t_gen_s=2000.0,
    t_train_s=1300.0,
    t_sync_s=25.0,
)
PUBLISHED_SPEC_SPEEDUP = PublishedSpeedup(
    source=(
        "a published measurement of speculative decoding in synchronous RL at 8B (EAGLE-3 drafter, k = 3): "
        "generation 100 -> 56.6 s, step 151.2 -> 107.5 s; k = 5 and k = 7 were worse"
    ),
    k=3,
    gen_speedup=100.0 / 56.6,
    step_speedup=151.2 / 107.5,
)


@dataclass
class Estimates:
    """The dry run's estimates; ``memory`` / ``step_time`` are None where they cannot be made
    (``notes`` say why)."""

    model: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    step_time: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    memory_estimate: MemoryEstimate | None = field(default=None, repr=False)
    step_plan: Any = field(default=None, repr=False)  # areal_npu.speculation.step_plan.Plan

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "memory": self.memory, "step_time": self.step_time, "notes": self.notes}


# ---- the model's shape ----


def read_model_config(path: str | Path, key: str = "--model-config") -> dict:
    """A Hugging Face ``config.json`` (or a checkpoint directory holding one) as a dict; a
    ConfigError naming ``key`` when it cannot be read."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"cannot read a model config from {str(path)!r} ({exc})") from None


def dims_from_config(config: dict, key: str) -> ModelDims:
    try:
        return ModelDims.from_hf_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(key, f"not a config the memory model reads ({type(exc).__name__}: {exc})") from None


def model_dims(cfg, model_config: str | None = None) -> tuple[ModelDims | None, str, list[str]]:
    """The recipe's model shape, where it comes from, and notes (see the module docstring)."""
    notes = []
    path = cfg.model.path
    on_machine = bool(path) and (Path(path).expanduser() / "config.json").is_file()
    if path and not Path(path).expanduser().exists():
        notes.append(
            f"model.path {path!r} is not on this machine: accepted for planning only (a real run refuses it)"
        )
    if model_config:
        source = str(model_config)
        if on_machine:
            notes.append(
                f"the model's shape comes from --model-config {source}, not from model.path's config.json"
            )
        return dims_from_config(read_model_config(model_config), "--model-config"), source, notes
    if on_machine:
        source = str(Path(path).expanduser() / "config.json")
        return dims_from_config(read_model_config(path, "model.path"), "model.path"), source, notes
    if not path:
        from areal_npu.model.tiny import hf_config

        return ModelDims.from_hf_config(hf_config(cfg.model.tiny)), "model.tiny (the tiny model)", notes
    notes.append("no memory estimate: give the model's config.json with --model-config")
    return None, "", notes


# ---- memory ----


def trainer_layout(cfg, trainer) -> ParallelLayout:
    """The memory model's layout for a plan's trainer (a :class:`~areal_npu.placement.TrainerLayout`)."""
    return ParallelLayout(
        dp=trainer.dp,
        tp=trainer.tp,
        cp=trainer.cp,
        pp=trainer.pp,
        backend=cfg.train.backend,
    )


def trained_mtp_depths(cfg) -> int:
    return cfg.mtp.num_depths if cfg.mtp.enabled and cfg.mtp.train else 0


def recipe_memory(cfg, dims: ModelDims, layout: ParallelLayout) -> MemoryEstimate:
    """Peak bytes per trainer device of one step of the recipe ``cfg`` (an ``RLConfig``)."""
    try:
        return estimate_step_memory(
            dims,
            cfg.train.packing.max_tokens_per_mb,
            layout,
            compute_dtype=cfg.train.dtype,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            logprob_chunk_size=cfg.train.logprob_chunk_size,
            mtp_depths=trained_mtp_depths(cfg),
        )
    except ValueError as exc:
        raise ConfigError("train", f"the memory model refuses this layout: {exc}") from None


def memory_dict(estimate: MemoryEstimate, device_bytes: float | None) -> dict[str, Any]:
    return {
        "bytes": dict(estimate.items),
        "forward_backward_phase": estimate.forward_backward_phase,
        "optimizer_phase": estimate.optimizer_phase,
        "peak": estimate.peak,
        "device_bytes": device_bytes,
        "fits": None if device_bytes is None else estimate.peak <= device_bytes,
        "inputs": estimate.inputs,
    }


# ---- step time ----


def plan_args(step: PublishedStep, speedup: PublishedSpeedup | None, scale: tuple[float, float]) -> list[str]:
    """``areal-npu plan`` arguments for the published step, its times scaled by (rollout, trainer)."""
    args = ["--t-gen", f"{step.t_gen_s * scale[0]:g}", "--t-train", f"{step.t_train_s * scale[1]:g}",
            "--t-sync", f"{step.t_sync_s:g}"]  # fmt: skip
    if speedup is not None:
        args += ["--gen-speedup", f"{speedup.gen_speedup:.4f}", "--k", str(speedup.k)]
    return args


def predict_step(cfg, dims: ModelDims, plan, step=PUBLISHED_STEP, speedup=PUBLISHED_SPEC_SPEEDUP):
    """``(step_plan.Plan, description)`` from the published figures, or ``(None, reason)``."""
    from areal_npu.speculation import step_plan

    if not step.matches(dims) or plan.device_kind != step.device:
        return None, (
            f"no step-time prediction: the published step times are for {step.model} on {step.device} "
            f"({step.chip}); `areal-npu plan RUN_DIR` predicts from a run's own metrics"
        )
    basis = [f"published figures: {step.source}"]
    chip = ASCEND_CHIPS.get(len(plan.device_ids))
    if chip != step.chip:
        basis.append(f"the published run was on {step.chip}; none is published for {chip or 'this node size'}: "
                     f"its times are used unchanged")  # fmt: skip
    rollout_devices = sum(len(p.devices) for p in plan.engines)
    trainer_devices = sum(len(p.devices) for p in plan.trainers)
    scale = (1.0, 1.0)
    if step.rollout_devices and step.trainer_devices:
        scale = (step.rollout_devices / rollout_devices, step.trainer_devices / trainer_devices)
        basis.append(f"times scaled linearly from the published run's {step.rollout_devices} rollout and "
                     f"{step.trainer_devices} trainer devices to this plan's {rollout_devices} and {trainer_devices}")  # fmt: skip
    else:
        basis.append(f"not scaled to this plan ({rollout_devices} rollout, {trainer_devices} trainer devices): "
                     "the published run's device counts and batch are not known")  # fmt: skip
    spec = cfg.rollout.spec
    use = speedup if spec.enabled and spec.is_mtp else None
    if use is not None:
        basis.append(f"speculation: {speedup.source}; taken as this recipe's MTP speed-up at k = {speedup.k} "
                     f"(recipe k = {spec.num_speculative_tokens}), as if the published rollouts had not speculated")  # fmt: skip
    args = plan_args(step, use, scale)
    parser = argparse.ArgumentParser(add_help=False)
    step_plan.add_step_arguments(parser)
    result = step_plan.plan_from_numbers(parser.parse_args(args))
    return result, {"basis": basis, "command": "areal-npu plan " + " ".join(args)}


# ---- the dry run ----


def _add_memory(out: Estimates, cfg, dims: ModelDims, layout: ParallelLayout, device_kind: str) -> None:
    estimate = recipe_memory(cfg, dims, layout)
    device_bytes = DEVICE_MEMORY_BYTES.get(device_kind)
    out.memory_estimate = estimate
    out.memory = memory_dict(estimate, device_bytes)
    if device_bytes is None:
        out.notes.append(f"no device memory known for {device_kind}: the estimate is not compared with it")
    else:
        out.notes.append(
            "the runtime and HCCL buffers take part of each device's memory besides this estimate"
        )
    out.notes.append(
        "rollout engines are not estimated: vLLM sizes its KV cache to rollout.gpu_memory_utilization"
    )


def _model_part(cfg, model_config: str | None) -> tuple[Estimates, ModelDims | None]:
    out = Estimates()
    dims, source, notes = model_dims(cfg, model_config)
    out.notes += notes
    if dims is not None:
        out.model = {"source": source, "parameters": dims.num_parameters(False),
                     "parameters_with_mtp": dims.num_parameters(True), "dims": dataclasses.asdict(dims)}  # fmt: skip
    return out, dims


def dry_run_estimates(cfg, plan, model_config: str | None = None) -> Estimates:
    """Memory per trainer device and the step-time prediction for ``plan`` of recipe ``cfg``."""
    out, dims = _model_part(cfg, model_config)
    if dims is None:
        return out
    _add_memory(out, cfg, dims, trainer_layout(cfg, plan.trainer), plan.device_kind)
    result, info = predict_step(cfg, dims, plan)
    if result is None:
        out.notes.append(info)
    else:
        out.step_plan = result
        out.step_time = {**info, "plan": dataclasses.asdict(result)}
        out.step_time["plan"]["ceiling"] = None if result.ceiling == float("inf") else result.ceiling
    return out


def recipe_memory_report(recipe: str, model_config: str | None = None) -> Estimates:
    """``areal-npu plan --memory RECIPE``: the memory estimate at the recipe's own layout
    (``train.dp_size`` x ``train.megatron.*``) on its ``device``, validated for that device as
    ``train --dry-run --device-kind`` does, without a placement plan or a step-time prediction."""
    import contextlib

    from omegaconf import OmegaConf

    from areal_npu.config import load_config
    from areal_npu.placement import TrainerLayout
    from areal_npu.platform import DEVICE_TYPES, described_device
    from areal_npu.recipe import RLConfig, planning_only

    try:
        declared = OmegaConf.load(recipe).get("device", "auto")
    except Exception:  # noqa: BLE001 - load_config below names what is wrong with the file
        declared = "auto"
    with contextlib.ExitStack() as scope:
        if declared in DEVICE_TYPES:
            scope.enter_context(described_device(declared))
        scope.enter_context(planning_only())
        cfg = load_config(RLConfig, recipe)
    out, dims = _model_part(cfg, model_config)
    if dims is not None:
        _add_memory(out, cfg, dims, trainer_layout(cfg, TrainerLayout.of(cfg.train)), cfg.device)
    return out


def render(est: Estimates, console=None) -> None:
    """The estimates as text, after the placement table."""
    from rich.console import Console
    from rich.markup import escape

    from areal_npu.memory_model import format_memory_table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
    if est.memory_estimate is not None:
        inputs = est.memory_estimate.inputs
        lay = inputs["layout"]
        console.print(
            f"\nmemory per trainer device: {lay['backend']} dp {lay['dp']} x tp {lay['tp']} x cp {lay['cp']} x "
            f"pp {lay['pp']}, {inputs['tokens_per_micro_batch']} tokens per micro-batch, {inputs['compute_dtype']}"
            f"{', activation checkpointing' if inputs['gradient_checkpointing'] else ''}, "
            f"{inputs['mtp_depths']} MTP depth(s); model from {escape(est.model['source'])} "
            f"({est.model['parameters'] / 1e9:.2f} B parameters)"
        )
        device_bytes = est.memory["device_bytes"]
        console.print(escape(format_memory_table(est.memory_estimate, device_bytes)), highlight=False)
    if est.step_plan is not None:
        from areal_npu.speculation import step_plan

        console.print(
            "\nstep time, predicted from published figures (" + escape(est.step_time["command"]) + "):"
        )
        for line in est.step_time["basis"]:
            console.print(f"  - {escape(line)}")
        step_plan.render(est.step_plan)
    for note in est.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
