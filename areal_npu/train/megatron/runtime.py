"""Importing Megatron-Core the way each device needs it, and its parallel state.

- NPU: ``mindspeed.megatron_adaptor`` must be imported *before* anything imports ``megatron``:
  MindSpeed replaces Megatron functions and classes (fused NPU kernels, ``torch.cuda`` -> ``torch.npu``)
  in the modules as they are imported, and names bound earlier keep the CUDA versions. MindSpeed is
  NPU-only (``import mindspeed`` needs ``torch_npu``); it is imported here, inside the NPU branch
  chosen by the device seam (:func:`areal_npu.platform.current_platform`), and nowhere else.
- CPU: Megatron-Core as is, plus the shims of :mod:`areal_npu.compat.megatron`.
- CUDA: Megatron-Core as is.

Every module of this package that needs Megatron imports it inside functions, after
:func:`import_megatron`.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch.distributed as dist

from areal_npu.platform import Platform, current_platform

__all__ = ["MINDSPEED_ADAPTOR", "SEED", "import_megatron", "init_parallel_state", "seed_model_parallel_rng"]

MINDSPEED_ADAPTOR = "mindspeed.megatron_adaptor"


def import_megatron(platform: Platform | None = None) -> ModuleType:
    """``megatron.core``, imported after MindSpeed's adaptor on the NPU and with the CPU shims on
    the CPU. Raises on the NPU when Megatron was imported before the adaptor (too late to patch)."""
    platform = platform or current_platform()
    if platform.device_type == "npu":
        if MINDSPEED_ADAPTOR not in sys.modules and any(
            name == "megatron" or name.startswith("megatron.") for name in sys.modules
        ):
            raise RuntimeError(
                "megatron was imported before mindspeed.megatron_adaptor: MindSpeed cannot patch it any more. "
                "Import Megatron only through areal_npu.train.megatron.runtime.import_megatron()"
            )
        importlib.import_module(MINDSPEED_ADAPTOR)
    core = importlib.import_module("megatron.core")
    if platform.device_type == "cpu":
        from areal_npu.compat.megatron import apply_cpu_patches

        apply_cpu_patches()
    return core


#: the default process group Megatron's groups were last made from (see init_parallel_state)
_groups_world = None


#: Megatron's default ``--seed``
SEED = 1234


def init_parallel_state(tp_size: int = 1, cp_size: int = 1, pp_size: int = 1, seed: int = SEED) -> None:
    """Megatron's process groups over the initialised default group (world = tp * cp * dp * pp),
    and its model-parallel RNG states (:func:`seed_model_parallel_rng`).

    Re-initialises when the layout differs from the current one (tests run several layouts in one
    process). Group order is Megatron's default ``tp-cp-ep-dp-pp``: TP ranks are adjacent."""
    global _groups_world
    import_megatron()
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed first (areal_npu.train.dist.init_distributed)")
    world = dist.get_world_size()
    if world % (tp_size * cp_size * pp_size):
        raise ValueError(f"world size {world} is not a multiple of tp*cp*pp = {tp_size * cp_size * pp_size}")
    if ps.model_parallel_is_initialized():
        same = (
            # groups made from a default group since destroyed (a finished run in the same
            # process, then a new one) are unregistered handles: make them again
            _groups_world is dist.group.WORLD
            and ps.get_tensor_model_parallel_world_size() == tp_size
            and ps.get_context_parallel_world_size() == cp_size
            and ps.get_pipeline_model_parallel_world_size() == pp_size
        )
        if same:
            seed_model_parallel_rng(seed)
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        create_gloo_process_groups=False,
    )
    _groups_world = dist.group.WORLD
    seed_model_parallel_rng(seed)


def seed_model_parallel_rng(seed: int = SEED) -> None:
    """Register Megatron's RNG states as its training loop does, after the groups exist:
    ``model_parallel_cuda_manual_seed`` (data-parallel ``seed``, tensor-parallel ``seed + 2718 +
    tp_rank``, expert-parallel). Sequence parallelism forks the tensor-parallel state around every
    layer, and the fork fails where it was never registered (also on the CPU: the tracker of
    :mod:`areal_npu.compat.megatron` keeps upstream's check)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
