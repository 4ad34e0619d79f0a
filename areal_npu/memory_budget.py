"""A trainer device's whole memory budget: the training step's estimate
(:func:`areal_npu.memory_model.estimate_step_memory`) plus what runs beside it, against the device.

Phases, each the steady state (fp32 masters, gradients, optimizer states, compute-dtype weights:
what stays allocated between steps) plus what that phase adds; the peak is the largest:

* **forward/backward** and **optimizer step**: the step estimate's two phases (the Gated DeltaNet
  sequence-parallel gather is one of its terms);
* **checkpoint** (the Megatron engine as written, ``train/megatron/checkpoint.py``): each rank
  writes the fp32 master and moment slices it owns where they lie (``dist_optim.py``: chunks are
  views, copied to the host one at a time; nothing gathered), and the HF export all-gathers one
  compute-dtype tensor at a time over TP and unshards it (two copies of the largest tensor: the
  embedding or the output head);
* **weight sync** (trainer rank 0, the sender): ``export_buckets`` gathers the compute-dtype
  weights one tensor at a time the same way (two copies of the largest tensor) and a collective
  transport stages each bucket on the device (``rollout.weight_bucket_bytes``, one uint8 buffer,
  ``rollout/collective.py``).

On top of the peak: **fragmentation** and the **reserve** the estimate cannot see (the device
runtime's context and workspaces, the collective library's buffers). Neither figure is in
``../shared/docs/REFERENCES.md``; both are assumptions, named where they are defined, and the
dry run prints them. The budget is compared with ``train.max_memory_fraction`` of the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_npu.memory_model import DTYPE_BYTES, GIB, MemoryEstimate, ModelDims

#: Assumption (not measured, not in REFERENCES.md): the allocator's fragmentation as a share of the
#: estimated peak. The scripts set ``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``, which grows
#: segments instead of cutting new ones; packed micro-batches of varying length still leave holes.
FRAGMENTATION = 0.05
#: Assumption: the device runtime's own memory on each device (CANN / torch_npu context, operator
#: workspaces, the caching allocator's first segments); CUDA contexts take ~0.5-1 GiB for comparison.
RUNTIME_RESERVE_BYTES = 2 * GIB
#: HCCL_BUFFSIZE's default, 200 MB (CANN's environment-variable reference; not in REFERENCES.md).
#: Assumption: each communicator a rank uses holds an input and an output buffer of that size.
HCCL_BUFFER_BYTES = 200 * 2**20
BUFFERS_PER_COMMUNICATOR = 2
STEADY_TERMS = (
    "parameters (fp32 master)",
    "gradients (fp32)",
    "optimizer states (AdamW, 2 x fp32)",
    "compute-dtype weights",
)


@dataclass
class DeviceBudget:
    """Bytes per trainer device: ``phases`` (name -> bytes), the ``extra`` terms each phase adds to
    the steady state, ``reserve`` (name -> bytes), ``fragmentation``, and the verdict against
    ``device_bytes`` (None: the device's memory is not known; no verdict)."""

    phases: dict[str, float]
    extra: dict[str, dict[str, float]]
    reserve: dict[str, float]
    fragmentation: float
    device_bytes: float | None
    max_fraction: float
    assumptions: list[str] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> float:
        return self.phases[self.peak_phase]

    @property
    def total(self) -> float:
        return self.peak + self.fragmentation + sum(self.reserve.values())

    @property
    def fraction(self) -> float | None:
        return None if self.device_bytes is None else self.total / self.device_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.fraction is None else self.fraction <= self.max_fraction

    def to_dict(self) -> dict[str, Any]:
        return {"phases": self.phases, "extra": self.extra, "reserve": self.reserve,
                "fragmentation": self.fragmentation, "peak_phase": self.peak_phase, "total": self.total,
                "device_bytes": self.device_bytes, "fraction": self.fraction, "max_fraction": self.max_fraction,
                "fits": self.fits, "assumptions": self.assumptions}  # fmt: skip


def largest_tensor(dims: ModelDims) -> int:
    """Elements of the model's largest single weight: the embedding / output head, or an MLP matrix."""
    return max(dims.vocab_size * dims.hidden_size, dims.hidden_size * dims.intermediate_size)


def communicators(tp: int, dp: int, cp: int, pp: int, sender: bool) -> int:
    """Collective groups a trainer rank moves data in: the world group, the tp / cp / pp / dp groups
    of size > 1, and on the sender (trainer rank 0) the weight-sync group."""
    return 1 + (tp > 1) + (cp > 1) + (pp > 1) + (dp > 1) + sender


def device_budget(
    estimate: MemoryEstimate,
    dims: ModelDims,
    *,
    device_kind: str,
    device_bytes: float | None,
    max_fraction: float,
    weight_bucket_bytes: int,
    collective_transport: bool,
) -> DeviceBudget:
    """The budget of trainer rank 0 (it also sends the weights), from the step ``estimate``."""
    inputs = estimate.inputs
    lay = inputs["layout"]
    tp, pp, dp, cp = lay["tp"], lay["pp"], lay["dp"], lay["cp"]
    c = DTYPE_BYTES[inputs["compute_dtype"]]
    steady = sum(estimate.items.get(name, 0.0) for name in STEADY_TERMS)
    big = largest_tensor(dims)
    extra = {
        "checkpoint": {
            "one compute-dtype tensor gathered over TP and unsharded (HF export)": 2 * c * big,
        },
        "weight sync": {
            "one compute-dtype tensor gathered over TP and unsharded": 2 * c * big,
            "transport bucket": float(weight_bucket_bytes) if collective_transport else 0.0,
        },
    }
    phases = {
        "forward/backward": estimate.forward_backward_phase,
        "optimizer step": estimate.optimizer_phase,
        "checkpoint": steady + sum(extra["checkpoint"].values()),
        "weight sync": steady + sum(extra["weight sync"].values()),
    }
    peak = max(phases.values())
    assumptions = [f"fragmentation {FRAGMENTATION:.0%} of the peak (assumed)"]
    reserve = {"runtime context and workspaces": float(RUNTIME_RESERVE_BYTES)}
    assumptions.append(f"runtime {RUNTIME_RESERVE_BYTES / GIB:.0f} GiB per device (assumed)")
    if device_kind == "npu":
        n = communicators(tp, dp, cp, pp, sender=collective_transport)
        reserve["HCCL buffers"] = float(n * BUFFERS_PER_COMMUNICATOR * HCCL_BUFFER_BYTES)
        assumptions.append(f"HCCL: {n} communicators x {BUFFERS_PER_COMMUNICATOR} x HCCL_BUFFSIZE 200 MB "
                           "(CANN's default; in + out buffers assumed)")  # fmt: skip
    return DeviceBudget(phases, extra, reserve, FRAGMENTATION * peak, device_bytes, max_fraction, assumptions)


def format_budget(budget: DeviceBudget) -> list[str]:
    """The budget's lines (GiB): phases, reserve, fragmentation, the total against the device."""
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    phases = ", ".join(f"{name} {g(b)}" for name, b in budget.phases.items())
    lines = [f"phases (GiB): {phases}; peak: {budget.peak_phase}"]
    for phase, terms in budget.extra.items():
        lines.append(f"  {phase} adds: " + ", ".join(f"{n} {g(b)}" for n, b in terms.items() if b))
    reserve = ", ".join(f"{n} {g(b)}" for n, b in budget.reserve.items())
    lines.append(f"reserve (GiB): {reserve}; fragmentation {g(budget.fragmentation)}")
    return lines
