"""fp32 master weights and the distributed optimizer (ZeRO-1) of the Megatron engine.

The model computes in ``train.dtype`` (bf16 or float32). Each parameter group (the policy, the MTP
head: its own lr, clipped apart) has one flat fp32 gradient buffer, *not* sharded: a
post-accumulate-grad hook adds every backward's gradient into it (fp32 over micro-batches, then
summed over ranks in fp32, :meth:`MasterOptimizer.reduce_grads`) and frees the bf16 ``.grad``. The
fp32 masters and AdamW's two moments are sharded over the DP x CP group (the group the gradients
are summed over, as Megatron's DistributedOptimizer shards): rank ``r`` of ``w`` owns the contiguous slice
``[r s, (r + 1) s)`` of the flat buffer (padded to ``w s``), steps ``torch.optim.AdamW`` on it
(elementwise: a sliced step equals the full one bit for bit), and the updated slices, cast to the
compute dtype, are all-gathered into every rank's parameters. With float32 the same path runs
(the masters are fp32 copies of the params, the gather copies them back: exact), and the params'
``.grad`` is pointed at the fp32 buffer after the reduction (as before).

Gradients are reduce-scattered over DP x CP, as Megatron's DistributedOptimizer does: each rank
receives the sum of its own slice only (an all-reduce moves twice the bytes: a reduce-scatter and
an all-gather). The norm is summed from the slices (:meth:`MasterOptimizer.slice_grads`, then over
DP x CP), clipping scales the slice, the step reads it. The rest of the buffer holds this rank's
unreduced gradient until someone asks for whole gradients (:meth:`MasterOptimizer.grads`: the
engine's ``hf_grads``, float32 params' ``.grad``), which all-gathers the slices first. Same memory
(the memory model's "fp32 gradients not sharded": the buffer accumulates whole micro-batches).

Why not Megatron-Core's own ``DistributedOptimizer`` (0.16.1, probed again on the CPU over gloo in
session 16): ``DistributedDataParallel`` allocates its grad buffer on ``torch.cuda.current_device()``
(``megatron/core/distributed/param_and_grad_buffer.py:800``; it builds under
:mod:`areal_npu.compat.megatron`'s ``current_device`` shim), then ``get_megatron_optimizer`` fails in
``DistributedOptimizer.__init__`` -> ``MixedPrecisionOptimizer.__init__`` on the literal
``device='cuda'`` (``megatron/core/optimizer/optimizer.py:473-485``; ``clip_grads.py:90-115`` too),
and ``_build_model_and_main_param_groups`` accepts a parameter only if ``param.type()`` is
``'torch.cuda.{Half,BFloat16,Float}Tensor'`` (``distrib_optimizer.py:361,420``, else ``TypeError`` at
430): shimming those means patching ``torch.tensor`` / ``torch.Tensor.type`` process-wide.
Its semantics differ too: ``ChainedOptimizer`` clips every chained optimizer by one joint norm
(the policy and the MTP head are clipped apart here), and ``finalize_model_grads`` all-reduces
norm gradients over TP only for sequence-parallel parameters (the per-head q/k norms are
TP-partial always), and its state is bucket-ordered shards, not the per-tensor slices that
:mod:`.dist_optim` writes and reshards on resume. On CUDA / the NPU it would run, but switching there
changes clipping, checkpoints and :meth:`MasterOptimizer.masters` / ``grads`` users at once with no
device to test on (none was lent in session 16): not done; the hand-written one runs everywhere.

Checkpoints (:mod:`.dist_optim`): each rank writes the slices of the masters and moments it owns
(never gathered); a resume reads its own ranges, so the TP and DP x CP sizes may change.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from areal_npu.train.optim import OptimConfig, build_optimizer

__all__ = ["MasterOptimizer"]


class _Group:
    """One parameter group's flat layout: names, params, offsets, fp32 gradient buffer, master slice."""

    def __init__(self, named: Mapping[str, torch.nn.Parameter], init, lr, rank: int, world: int):
        self.names = list(named)
        self.params = [named[n] for n in self.names]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"one compute dtype per parameter group, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.numel = sum(p.numel() for p in self.params)
        self.shard = -(-self.numel // world)  # ceil: every rank owns one slice (the last padded)
        self.start = rank * self.shard
        device = self.params[0].device
        self.grad = torch.zeros(self.shard * world, dtype=torch.float32, device=device)
        self.views, offset = {}, 0
        for name, p in zip(self.names, self.params):
            self.views[name] = self.grad[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        full = self.flat_fp32({n: (init or {}).get(n, named[n]) for n in self.names})
        self.master = torch.nn.Parameter(full[self.start : self.start + self.shard].clone())
        self.lr = lr

    def flat_fp32(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat fp32 buffer (padded) of ``tensors`` (this group's names)."""
        flat = torch.zeros_like(self.grad)
        offset = 0
        for name, p in zip(self.names, self.params):
            flat[offset : offset + p.numel()] = tensors[name].detach().reshape(-1).to(flat)
            offset += p.numel()
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, p in zip(self.names, self.params):
            out[name] = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out


class MasterOptimizer:
    """AdamW on fp32 master slices sharded over ``group`` (None: one rank), for parameters that
    compute in bf16 or float32. ``groups``: ``{"named": {name: param}, "init": {name: fp32
    tensor} or None, "lr": float or None}``; ``init`` gives the masters their fp32 values (the
    loaded checkpoint's, not the bf16-rounded params)."""

    def __init__(self, groups: list[dict], cfg: OptimConfig, group=None):
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self._sliced = False  # the buffers hold reduced slices only (reduce_grads), not whole gradients
        self.groups = [_Group(g["named"], g.get("init"), g.get("lr"), self.rank, self.world) for g in groups]
        param_groups = [
            {"params": [g.master], **({"lr": g.lr} if g.lr is not None else {})} for g in self.groups
        ]
        self.optimizer, self.scheduler = build_optimizer(param_groups, cfg)
        for g in self.groups:
            for name, p in zip(g.names, g.params):
                p.register_post_accumulate_grad_hook(self._accumulate(g.views[name]))

    @staticmethod
    def _accumulate(view: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            view.add_(param.grad)  # fp32 += this backward's gradient (any dtype)
            param.grad = None

        return hook

    # ---- gradients -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad.zero_()
            g.master.grad = None
            for p in g.params:
                p.grad = None
        self._sliced = False

    def reduce_grads(self) -> None:
        """Sum every rank's gradients over ``group``, each rank receiving its own slice
        (``reduce_scatter_tensor``); then float32 params' ``.grad`` point at the buffer
        (:meth:`grads` whole). Collective over ``group``."""
        if self.world > 1:
            for g in self.groups:
                mine = torch.empty(g.shard, dtype=g.grad.dtype, device=g.grad.device)
                dist.reduce_scatter_tensor(mine, g.grad, group=self.group)
                g.grad[g.start : g.start + g.shard].copy_(mine)
            self._sliced = True
        if any(g.dtype == torch.float32 for g in self.groups):
            self._whole()
            for g in self.groups:
                if g.dtype == torch.float32:
                    for name, p in zip(g.names, g.params):
                        p.grad = g.views[name]

    def _whole(self) -> None:
        """Every rank's reduced slice into every rank's buffer (``all_gather_into_tensor``)."""
        if self._sliced:
            for g in self.groups:
                dist.all_gather_into_tensor(g.grad, g.grad[g.start : g.start + g.shard].clone(), group=self.group)
            self._sliced = False

    def grads(self, index: int) -> dict[str, torch.Tensor]:
        """Group ``index``'s accumulated fp32 gradients by name (views of its buffer), whole: after
        :meth:`reduce_grads` the first call all-gathers the slices (collective over ``group``)."""
        self._whole()
        return self.groups[index].views

    def slice_grads(self, index: int) -> dict[str, torch.Tensor]:
        """The parts of group ``index``'s gradients in this rank's slice, by name (views of the
        buffer; names outside the slice absent): what the step reads, the norm sums and clipping
        scales. Over ``group`` the slices cover every gradient once."""
        g = self.groups[index]
        out, offset, end = {}, 0, g.start + g.shard
        for name, p in zip(g.names, g.params):
            lo, hi = max(offset, g.start), min(offset + p.numel(), end)
            if lo < hi:
                out[name] = g.grad[lo:hi]
            offset += p.numel()
        return out

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """AdamW on this rank's slices, one schedule step, then every rank's params from the masters."""
        for g in self.groups:
            g.master.grad = g.grad[g.start : g.start + g.shard]
        self.optimizer.step()
        self.scheduler.step()
        for g in self.groups:
            g.master.grad = None
        self.refresh_params()

    @torch.no_grad()
    def refresh_params(self) -> None:
        for g in self.groups:
            local = g.master.detach().to(g.dtype)
            full = g.unflatten(self._gather(local))
            for name, p in zip(g.names, g.params):
                p.copy_(full[name])

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return local
        full = torch.empty(local.numel() * self.world, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(full, local.contiguous(), group=self.group)
        return full

    # ---- weights and state ------------------------------------------------------------------
    @torch.no_grad()
    def masters(self, index: int) -> dict[str, torch.Tensor]:
        """Group ``index``'s full fp32 masters by name (this TP shard). Collective over ``group``."""
        g = self.groups[index]
        return {n: t.clone() for n, t in g.unflatten(self._gather(g.master.detach())).items()}

    def names(self, index: int) -> list[str]:
        return list(self.groups[index].names)

    def state_bytes(self) -> int:
        """Bytes of fp32 masters and AdamW moments this rank holds."""
        total = sum(g.master.numel() * g.master.element_size() for g in self.groups)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if v.dim() > 0)
        return total


def optimizer_step(engine, step: int | None = None, bump_version: bool = True) -> dict[str, float]:
    """:meth:`MegatronEngine.optimizer_step`: clip the policy and the MTP head apart (:mod:`.grads`;
    each rank its slice), refuse non-finite norms (nothing applied), step the masters, refresh the params."""
    from areal_npu.train.base import optimizer_stats, refuse_non_finite
    from areal_npu.train.megatron.grads import clip_groups

    step = engine.version if step is None else step
    opt = engine.optimizer
    groups = [(engine.grad_norm(), list(opt.slice_grads(0).values()))]
    if engine.mtp_config.enabled:  # every stage learns the norm; the last holds the head
        groups.append((engine.grad_norm(mtp=True), list(opt.slice_grads(1).values()) if engine.mtp else []))
    norms = [n for n, _ in groups]
    refuse_non_finite(norms, step, opt.zero_grad)
    clip_groups(groups, engine.config.optim.grad_clip)
    opt.step()
    if bump_version:
        engine.version += 1
    return optimizer_stats(norms[0], opt.scheduler.get_last_lr()[0], engine.version)
