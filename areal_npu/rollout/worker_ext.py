"""Runs inside every vLLM worker process (``--worker-extension-cls``): in-place weight reload.

Reached through ``collective_rpc("areal_*", args=...)``. Tensors arrive as safetensors bytes
(plain tensors would arrive as lists), or from the trainer's broadcast into a buffer of this
worker's (``collective.py``: ``areal_collective_init``, ``areal_receive_bucket``). Why not
``model.load_weights`` alone: the CPU backend repacks linear weights after loading, and a captured
graph (vLLM-Ascend's ACLGraph) reads the old tensors' addresses, so updates go through vLLM's
layer-wise reload, which runs that processing again and copies the result into the tensors in
place (``rollout/inplace_reload.py``: the sequence and its checks). The MTP drafter is a separate
module in vLLM: loading the policy refreshes only what it shares with the drafter (embedding,
output head), so the drafter's own ``mtp.*`` weights get their own session against the drafter
module (``get_draft_model()`` on vLLM 0.32; the model runner's ``drafter.model`` on 0.23 and on
vLLM-Ascend 0.23), as do the EAGLE-3 drafter's (``fc``, ``midlayer.*``, ``norm``). vLLM-Ascend
leaves an ``eagle3`` drafter an output head of its own, which our checkpoint never fills: the server
and every update copy the policy's head into it (``inplace_reload.tie_draft_head``).
"""

from __future__ import annotations

from areal_npu.compat.vllm import cpu_mamba, cpu_sampling, spec_off
from areal_npu.compat.vllm import features as vllm_version
from areal_npu.rollout.inplace_reload import InPlaceReloadMixin

# vLLM imports this class in each worker right after registering its CPU kernel overrides: the
# moment to replace the broken one (see areal_npu/compat/vllm/cpu_sampling.py).
cpu_sampling.apply()
# adaptive speculation: no drafter forward while k = 0 (only when the server asked for it)
spec_off.apply()
if vllm_version.has("cpu_kernel_registry"):  # registers through 0.32's kernel registry (0.23 has none)
    cpu_mamba.apply()  # hybrid + speculation + prefix caching on the CPU (compat/vllm/cpu_mamba.py)


class WeightSyncExtension(InPlaceReloadMixin):
    """Mixed into vLLM's Worker class; ``self`` is the worker. The in-place reload sessions
    (``areal_begin_update`` / ``areal_load_bucket`` / ``areal_finish_update``) are
    :class:`~areal_npu.rollout.inplace_reload.InPlaceReloadMixin`'s."""

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

        from areal_npu.rollout.collective import broadcast, unflatten

        self._areal_session(target)
        group = getattr(self, "_areal_group", None)
        if group is None:
            raise RuntimeError("no weight-broadcast group: /areal/update_weights/collective/init first")
        # the worker's device: in an open session the model's own parameters are on the meta device
        device = torch.device("cpu") if self._areal_group_backend == "gloo" else torch.device(self.device)
        flat = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
        try:
            broadcast(group, flat)
        except Exception:
            self._areal_group = None
            raise
        return self._areal_load(target, unflatten(flat, layout))

    def areal_param_sums(self, target: str) -> dict[str, float]:
        """Sum of every parameter (for diagnostics and tests: did the update land?)."""
        model, _ = self._areal_target(target)
        return {name: float(p.detach().float().sum()) for name, p in model.named_parameters()}
