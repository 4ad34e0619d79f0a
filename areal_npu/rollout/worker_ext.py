"""Runs inside every vLLM worker process (``--worker-extension-cls``): in-place weight reload.

Reached through ``collective_rpc("areal_*", args=...)``. Tensors arrive as safetensors bytes
(plain tensors would arrive as lists), or from the trainer's broadcast into a buffer of this
worker's (``collective.py``: ``areal_collective_init``, ``areal_receive_bucket``). Why not ``model.load_weights``: the CPU backend repacks
linear weights after loading, so updates go through vLLM's layer-wise reload, which runs that
processing again (``initialize_layerwise_reload`` -> ``load_weights`` per bucket ->
``finalize_layerwise_reload``). The MTP drafter is a separate module in vLLM: loading the policy
refreshes only what it shares with the drafter (embedding, output head), so the drafter's own
``mtp.*`` weights get their own session against the drafter module (``get_draft_model()`` on
vLLM 0.32; the model runner's ``drafter.model`` on 0.23, which has the same layer-wise helpers).
"""

from __future__ import annotations

from areal_npu.compat.vllm import cpu_mamba, cpu_sampling, spec_off
from areal_npu.compat.vllm import features as vllm_version

# vLLM imports this class in each worker right after registering its CPU kernel overrides: the
# moment to replace the broken one (see areal_npu/compat/vllm/cpu_sampling.py).
cpu_sampling.apply()
# adaptive speculation: no drafter forward while k = 0 (only when the server asked for it)
spec_off.apply()
if vllm_version.has("cpu_kernel_registry"):  # registers through 0.32's kernel registry (0.23 has none)
    cpu_mamba.apply()  # hybrid + speculation + prefix caching on the CPU (compat/vllm/cpu_mamba.py)

TARGETS = ("policy", "draft")


class WeightSyncExtension:
    """Mixed into vLLM's Worker class; ``self`` is the worker."""

    def _areal_target(self, target: str):
        if target == "policy":
            return self.get_model(), self.vllm_config.model_config
        if target == "draft":
            model = self._areal_draft_model()
            spec = self.vllm_config.speculative_config
            if model is None or spec is None or spec.draft_model_config is None:
                raise RuntimeError("draft weight update requested but this engine has no drafter")
            return model, spec.draft_model_config
        raise ValueError(f"target must be one of {TARGETS}; got {target!r}")

    def _areal_draft_model(self):
        """The drafter's ``nn.Module`` (None without one). vLLM 0.32 exposes it as
        ``get_draft_model()``; 0.23 does not, and its weight-transfer engines load the target only
        (vLLM-Ascend 0.23 likewise), so we take it from the model runner's proposer, as 0.32's accessor does."""
        if vllm_version.has("draft_model_accessor"):
            return self.get_draft_model()
        drafter = getattr(self.model_runner, "drafter", None)  # absent when speculation is off
        model = getattr(drafter, "model", None)
        unwrap = getattr(model, "unwrap", None)  # graph wrappers (not on the CPU: enforce_eager)
        return unwrap() if callable(unwrap) else model

    def areal_begin_update(self, target: str) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model, _ = self._areal_target(target)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        self._areal_loaded = {"target": target, "names": 0}

    def areal_load_bucket(self, target: str, payload: bytes) -> int:
        import torch
        from vllm.config import set_current_vllm_config

        from areal_npu.rollout.buckets import unpack_bucket

        state = getattr(self, "_areal_loaded", None)
        if state is None or state["target"] != target:
            raise RuntimeError(f"areal_load_bucket({target!r}) without areal_begin_update({target!r})")
        model, _ = self._areal_target(target)
        weights = unpack_bucket(payload)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            model.load_weights(iter(weights))
        state["names"] += len(weights)
        return len(weights)

    def areal_finish_update(self, target: str) -> int:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model, model_config = self._areal_target(target)
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, model_config)
        state = getattr(self, "_areal_loaded", None) or {"names": 0}
        self._areal_loaded = None
        return int(state["names"])

    # ---- the broadcast transport (collective.py): a group of its own, buckets into the model ----

    def areal_collective_init(self, group: dict, local_addr: str) -> int:
        """Join the trainer's weight-broadcast group as rank ``rank_offset + self.rank`` (a group
        this worker held before is dropped first); returns the rank."""
        from areal_npu.rollout.collective import GroupInfo, join_group

        self._areal_group = None
        info = GroupInfo(**group)
        rank = info.rank_offset + self.rank
        self._areal_group = join_group(info, rank, local_addr)
        self._areal_group_backend = info.backend
        return rank

    def areal_receive_bucket(self, target: str, layout: dict) -> int:
        """One bucket from the trainer's broadcast, loaded into ``target`` in the open session. A
        failed broadcast drops the group (the trainer builds a new one for the next try)."""
        import torch
        from vllm.config import set_current_vllm_config

        from areal_npu.rollout.collective import broadcast, unflatten

        state = getattr(self, "_areal_loaded", None)
        if state is None or state["target"] != target:
            raise RuntimeError(f"areal_receive_bucket({target!r}) without areal_begin_update({target!r})")
        group = getattr(self, "_areal_group", None)
        if group is None:
            raise RuntimeError("no weight-broadcast group: /areal/update_weights/collective/init first")
        model, _ = self._areal_target(target)
        device = torch.device("cpu") if self._areal_group_backend == "gloo" else next(model.parameters()).device
        flat = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
        try:
            broadcast(group, flat)
        except Exception:
            self._areal_group = None
            raise
        weights = unflatten(flat, layout)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            model.load_weights(iter(weights))
        state["names"] += len(weights)
        return len(weights)

    def areal_param_sums(self, target: str) -> dict[str, float]:
        """Sum of every parameter (for diagnostics and tests: did the update land?)."""
        model, _ = self._areal_target(target)
        return {name: float(p.detach().float().sum()) for name, p in model.named_parameters()}
