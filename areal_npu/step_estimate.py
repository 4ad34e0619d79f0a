"""What ``areal-npu train RECIPE --dry-run`` prints beside the placement plan: the trainer's memory
budget per device and a step-time prediction. Both are estimates for machines the dry run does not
run on; nothing here allocates a device or starts a process.

* **Memory**: :func:`areal_npu.memory_model.estimate_step_memory` for one trainer rank of the
  planned layout (dp / tp / cp / pp from the plan, the recipe's ``train.backend``), one packed
  micro-batch of ``train.packing.max_tokens_per_mb`` tokens, the recipe's compute dtype, activation
  checkpointing, sequence parallelism, log-prob chunk and trained MTP depths; then
  :func:`areal_npu.memory_budget.device_budget` (checkpoint and weight-sync phases, fragmentation,
  runtime and HCCL reserve) against the device's memory (:data:`DEVICE_MEMORY_BYTES`) and
  ``train.max_memory_fraction`` of it: above it the plan is refused (:attr:`Estimates.refusal`,
  with the layouts that would fit). One packed segment per micro-batch is assumed. The rollout
  engines are not estimated: vLLM sizes its KV cache to ``rollout.gpu_memory_utilization``.
* **Model shape**: a config file given with ``--model-config`` (the 64K recipes' scripts pass the
  shipped one where the checkpoint is absent), else ``model.path``'s ``config.json``, else the tiny
  model of ``model.tiny`` when ``model.path`` is empty.
* **Step time**: :mod:`areal_npu.step_cost` (per-token costs of the published run times this plan's
  tokens, devices and layout) when the published run describes this model on this kind of device;
  otherwise no prediction, and a note says so. ``areal-npu plan`` reproduces its k sweep.

``areal-npu plan --memory RECIPE`` prints the memory part alone, at the recipe's own layout
(:func:`recipe_memory_report`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_npu.config import ConfigError
from areal_npu.memory_budget import DeviceBudget, device_budget
from areal_npu.memory_model import GIB, MemoryEstimate, ModelDims, ParallelLayout, estimate_step_memory
from areal_npu.step_cost import PUBLISHED_RUN, PublishedRun, StepConfig, StepTime, step_time
from areal_npu.train.factory import check_megatron_layout

#: Memory of one device: an Ascend A2 (910B) NPU and one A3 (910C) die each have 64 GB of HBM.
#: Other kinds differ from machine to machine: no verdict is printed for them.
DEVICE_MEMORY_BYTES = {"npu": 64 * GIB}
#: Devices per node that identify the Ascend chip of a described NPU cluster.
ASCEND_CHIPS = {8: "A2", 16: "A3"}


@dataclass
class Estimates:
    """The dry run's estimates; ``memory`` / ``step_time`` are None where they cannot be made
    (``notes`` say why)."""

    model: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    step_time: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    refusal: str | None = None  # why the plan is refused (memory above the fraction), and what to change
    memory_estimate: MemoryEstimate | None = field(default=None, repr=False)
    budget: DeviceBudget | None = field(default=None, repr=False)
    step: StepTime | None = field(default=None, repr=False)
    step_plan: Any = field(default=None, repr=False)  # areal_npu.speculation.step_plan.Plan

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "memory": self.memory, "step_time": self.step_time, "notes": self.notes,
                "refusal": self.refusal}  # fmt: skip


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
        dp=trainer.dp, tp=trainer.tp, cp=trainer.cp, pp=trainer.pp, backend=cfg.train.backend
    )


def trained_mtp_depths(cfg) -> int:
    return cfg.mtp.num_depths if cfg.mtp.enabled and cfg.mtp.train else 0


def recipe_memory(cfg, dims: ModelDims, layout: ParallelLayout) -> MemoryEstimate:
    """Peak bytes per trainer device of one step of the recipe ``cfg`` (an ``RLConfig``)."""
    megatron = cfg.train.backend == "megatron"
    try:
        return estimate_step_memory(
            dims,
            cfg.train.packing.max_tokens_per_mb,
            layout,
            compute_dtype=cfg.train.dtype,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            logprob_chunk_size=cfg.train.logprob_chunk_size,
            mtp_depths=trained_mtp_depths(cfg),
            sequence_parallel=megatron and cfg.train.megatron.sequence_parallel,
        )
    except ValueError as exc:
        raise ConfigError("train", f"the memory model refuses this layout: {exc}") from None


def recipe_budget(
    cfg, dims: ModelDims, layout: ParallelLayout, device_kind: str
) -> tuple[MemoryEstimate, DeviceBudget]:
    """The step estimate and the device budget of trainer rank 0 for ``layout`` on ``device_kind``."""
    from dataclasses import replace

    estimate = recipe_memory(cfg, dims, layout)
    transport = replace(cfg.rollout, device=device_kind).resolved_transport()
    budget = device_budget(
        estimate, dims, device_kind=device_kind, device_bytes=DEVICE_MEMORY_BYTES.get(device_kind),
        max_fraction=cfg.train.max_memory_fraction, weight_bucket_bytes=cfg.rollout.weight_bucket_bytes,
        collective_transport=transport != "rpc",
    )  # fmt: skip
    return estimate, budget


def memory_dict(estimate: MemoryEstimate, budget: DeviceBudget) -> dict[str, Any]:
    return {
        "bytes": dict(estimate.items),
        "forward_backward_phase": estimate.forward_backward_phase,
        "optimizer_phase": estimate.optimizer_phase,
        "peak": estimate.peak,
        "device_bytes": budget.device_bytes,
        "fits": budget.fits,
        "budget": budget.to_dict(),
        "inputs": estimate.inputs,
    }


def layout_allowed(cfg, dims: ModelDims, tp: int, cp: int, pp: int) -> bool:
    """Whether the model splits over tp / cp / pp: attention heads over tp (key/value heads divide
    or are replicated), Gated DeltaNet heads over tp x cp, layers evenly over pp; and whether the
    Megatron engine takes the recipe at that layout (:func:`check_megatron_layout`: e.g. a loss that
    needs whole sequences, under cp); the FSDP2 engine has dp only."""
    if cfg.train.backend != "megatron":
        return tp == cp == pp == 1
    kv = dims.num_key_value_heads
    if dims.num_attention_heads % tp or (kv % tp and tp % kv) or dims.num_layers % pp:
        return False
    try:
        check_megatron_layout(cfg, tp, cp, pp)
    except ConfigError:
        return False
    linear = "linear_attention" in dims.layer_types
    return not linear or not (
        dims.linear_num_key_heads % (tp * cp) or dims.linear_num_value_heads % (tp * cp)
    )


def alternatives(cfg, dims: ModelDims, layout: ParallelLayout, device_kind: str, node_size: int) -> list[str]:
    """Layouts on the same or twice the trainer devices whose budget fits, fewest devices and lowest
    fraction first (at most three); when none fits, the closest two."""
    world = layout.dp * layout.tp * layout.cp * layout.pp
    tried = []
    for scale in (1, 2):
        for tp in sorted({layout.tp, layout.tp * 2, max(layout.tp // 2, 1)}):
            for pp in (1, 2, 4):
                for cp in (1, 2):
                    if (
                        tp > node_size
                        or (world * scale) % (tp * cp * pp)
                        or not layout_allowed(cfg, dims, tp, cp, pp)
                    ):
                        continue
                    change = dict(dp=world * scale // (tp * cp * pp), tp=tp, cp=cp, pp=pp)
                    if change == dict(dp=layout.dp, tp=layout.tp, cp=layout.cp, pp=layout.pp):
                        continue
                    _, budget = recipe_budget(cfg, dims, dataclasses.replace(layout, **change), device_kind)
                    keys = " ".join(f"train.megatron.{d}_size={change[d]}" for d in ("tp", "pp", "cp")
                                    if change[d] != getattr(layout, d))  # fmt: skip
                    where = (
                        "the same trainer devices" if scale == 1 else "twice the trainer devices (NNODES x 2)"
                    )
                    label = f"dp {change['dp']} x tp {tp} x pp {pp} x cp {cp} on {where}" + (
                        f" ({keys})" if keys else ""
                    )
                    tried.append((not budget.fits, scale, budget.fraction, f"{label}: {budget.fraction:.0%}"))
    tried.sort()
    fitting = [t[3] for t in tried if not t[0]][:3]
    return fitting or [
        "none of " + str(len(tried)) + " layouts tried fits; closest: " + "; ".join(t[3] for t in tried[:2])
    ]


def _phase_hint(budget: DeviceBudget) -> str:
    if budget.peak_phase != "checkpoint":
        return ""
    rest = max(v for k, v in budget.phases.items() if k != "checkpoint")
    frac = (
        rest * (1 + budget.fragmentation / budget.peak) + sum(budget.reserve.values())
    ) / budget.device_bytes
    return (": the Megatron checkpoint gathers this TP shard's fp32 masters on the device; "
            f"without that phase {frac:.0%}")  # fmt: skip


def _add_memory(
    out: Estimates, cfg, dims: ModelDims, layout: ParallelLayout, device_kind: str, node_size: int
) -> None:
    estimate, budget = recipe_budget(cfg, dims, layout, device_kind)
    out.memory_estimate, out.budget = estimate, budget
    out.memory = memory_dict(estimate, budget)
    if budget.device_bytes is None:
        out.notes.append(f"no device memory known for {device_kind}: the budget is not compared with it")
    elif not budget.fits:
        options = "; ".join(alternatives(cfg, dims, layout, device_kind, node_size))
        out.refusal = (
            f"the trainer's memory budget is {budget.total / GIB:.1f} GiB per device, {budget.fraction:.0%} of "
            f"{budget.device_bytes / GIB:.0f} GiB, above train.max_memory_fraction={budget.max_fraction:g} "
            f"(peak in the {budget.peak_phase} phase{_phase_hint(budget)}). Layouts that fit: {options}; "
            "or shorten train.packing.max_tokens_per_mb, or raise train.max_memory_fraction knowingly"
        )
    out.notes.append(
        "rollout engines are not estimated: vLLM sizes its KV cache to rollout.gpu_memory_utilization"
    )


# ---- step time ----


def step_config(cfg, dims: ModelDims, plan) -> StepConfig:
    """The :class:`StepConfig` of recipe ``cfg`` on ``plan``."""
    shell = getattr(cfg.workflow, "shell", None)
    spec = cfg.rollout.spec
    group = cfg.workflow.group_size
    return StepConfig(
        episodes=cfg.controller.batch_groups * group,
        episode_tokens=shell.max_tokens if shell is not None else cfg.rollout.max_model_len,
        mb_tokens=cfg.train.packing.max_tokens_per_mb,
        weight_bytes=2 * dims.num_parameters(with_mtp=dims.mtp_num_hidden_layers > 0),
        dp=plan.trainer.dp, tp=plan.trainer.tp, cp=plan.trainer.cp, pp=plan.trainer.pp,
        engines=plan.num_engines, engine_tp=plan.engine_tp,
        in_flight=cfg.controller.max_concurrent_groups * group,
        spec_k=spec.num_speculative_tokens if spec.enabled else 0,
    )  # fmt: skip


def matches(run: PublishedRun, dims: ModelDims) -> bool:
    values = {"num_layers": dims.num_layers, **dataclasses.asdict(dims)}
    return all(values.get(name) == value for name, value in run.shape)


def predict_step(cfg, dims: ModelDims, plan, run: PublishedRun = PUBLISHED_RUN):
    """``(StepTime, info)`` from the published run's per-token costs, or ``(None, reason)``."""
    if not matches(run, dims) or plan.device_kind != run.device:
        return None, (
            f"no step-time prediction: the one published timing is for {run.model} on {run.device} "
            f"({run.chip}); `areal-npu plan RUN_DIR` predicts from a run's own metrics"
        )
    config = step_config(cfg, dims, plan)
    result = step_time(config, run.costs())
    assumptions = [f"published run: {run.assumed}"]
    chip = ASCEND_CHIPS.get(len(plan.device_ids))
    if chip != run.chip:
        assumptions.append(
            f"per-device costs of {run.chip} taken for {chip or 'this node size'} (none published)"
        )
    assumptions += [
        f"speed-up {run.gen_speedup_source}" if config.spec_k else "no speculation in this recipe",
        "tp/cp scale perfectly; phases added (an upper bound: max_staleness >= 1 overlaps them)",
        *result.notes,
    ]
    args = [
        "--t-gen",
        f"{result.t_gen_ar:.6g}",
        "--t-train",
        f"{result.t_train:.6g}",
        "--t-sync",
        f"{result.t_sync:.6g}",
    ]
    if config.spec_k:
        args += ["--gen-speedup", f"{result.gen_speedup:.4f}", "--k", str(config.spec_k)]
    info = {
        "source": run.source,
        "assumptions": assumptions,
        "config": dataclasses.asdict(config),
        "seconds": {"gen": result.t_gen, "gen_autoregressive": result.t_gen_ar, "gen_speedup": result.gen_speedup,
                    "train": result.t_train, "sync": result.t_sync, "step": result.t_step},
        "command": "areal-npu plan " + " ".join(args),
    }  # fmt: skip
    return result, info


def _step_plan(command: str):
    """``areal-npu plan``'s view of the same numbers (its k sweep, for --verbose)."""
    import argparse
    import shlex

    from areal_npu.speculation import step_plan

    parser = argparse.ArgumentParser(add_help=False)
    step_plan.add_step_arguments(parser)
    return step_plan.plan_from_numbers(parser.parse_args(shlex.split(command)[2:]))


# ---- the dry run ----


def _model_part(cfg, model_config: str | None) -> tuple[Estimates, ModelDims | None]:
    out = Estimates()
    dims, source, notes = model_dims(cfg, model_config)
    out.notes += notes
    if dims is not None:
        out.model = {"source": source, "parameters": dims.num_parameters(False),
                     "parameters_with_mtp": dims.num_parameters(True), "dims": dataclasses.asdict(dims)}  # fmt: skip
    return out, dims


def dry_run_estimates(cfg, plan, model_config: str | None = None) -> Estimates:
    """The memory budget per trainer device and the step-time prediction for ``plan`` of recipe ``cfg``."""
    out, dims = _model_part(cfg, model_config)
    if dims is None:
        return out
    _add_memory(out, cfg, dims, trainer_layout(cfg, plan.trainer), plan.device_kind, len(plan.device_ids))
    result, info = predict_step(cfg, dims, plan)
    if result is None:
        out.notes.append(info)
    else:
        out.step, out.step_time = result, info
        out.step_plan = _step_plan(info["command"])
    return out


def recipe_memory_report(recipe: str, model_config: str | None = None) -> Estimates:
    """``areal-npu plan --memory RECIPE``: the memory budget at the recipe's own layout
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
        layout = trainer_layout(cfg, TrainerLayout.of(cfg.train))
        _add_memory(out, cfg, dims, layout, cfg.device, max(ASCEND_CHIPS))  # node size unknown: A3's
    return out


def memory_line(est: Estimates) -> str:
    """One line: the budget per trainer device against the device and the limit."""
    b = est.budget
    reserve = sum(b.reserve.values())
    line = (f"{b.total / GIB:.1f} GiB per trainer device = peak {b.peak / GIB:.1f} ({b.peak_phase}) + reserve "
            f"{reserve / GIB:.1f} + fragmentation {b.fragmentation / GIB:.1f}")  # fmt: skip
    if b.device_bytes is None:
        return line + "; the device's memory is not known"
    verdict = "within" if b.fits else "ABOVE"
    return line + (f"; {b.fraction:.0%} of {b.device_bytes / GIB:.0f} GiB, {verdict} the limit "
                   f"{b.max_fraction:.0%} (train.max_memory_fraction)")  # fmt: skip


def render(est: Estimates, console=None) -> None:
    """The memory budget as text (``areal-npu plan --memory``; the dry run adds its own summary)."""
    from rich.console import Console
    from rich.markup import escape

    from areal_npu.memory_budget import format_budget
    from areal_npu.memory_model import format_memory_table

    console = console or Console(width=160)
    if est.memory_estimate is not None:
        inputs = est.memory_estimate.inputs
        lay = inputs["layout"]
        console.print(
            f"memory per trainer device: {lay['backend']} dp {lay['dp']} x tp {lay['tp']} x cp {lay['cp']} x "
            f"pp {lay['pp']}, {inputs['tokens_per_micro_batch']} tokens per micro-batch, {inputs['compute_dtype']}"
            f"{', activation checkpointing' if inputs['gradient_checkpointing'] else ''}"
            f"{', sequence parallel' if inputs['sequence_parallel'] else ''}, "
            f"{inputs['mtp_depths']} MTP depth(s); model from {escape(est.model['source'])} "
            f"({est.model['parameters'] / 1e9:.2f} B parameters)",
            highlight=False,
        )
        console.print(escape(format_memory_table(est.memory_estimate)), highlight=False)
        for line in format_budget(est.budget) + [memory_line(est)] + est.budget.assumptions:
            console.print(escape(line), highlight=False)
    for note in est.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if est.refusal:
        console.print(f"[red]above the limit (train --dry-run refuses it):[/] {escape(est.refusal)}")
