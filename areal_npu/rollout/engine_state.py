"""What one engine process's ``/areal`` routes share: the weight version, the open weight update and
whether the model holds partly loaded weights, and the draft length it runs; and the one step that
makes a new version's KV cache clean (``drop_stale_kv``).

The routes (``generation_routes``, ``weight_routes``, ``spec_routes``) read and change it under
``lock`` where an update is involved; ``server.py`` builds it once the vLLM engine is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.rollout import vllm_features
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation import k_driver


class UpdateSession:
    """One weight update between ``begin`` and ``commit``: staged RPC buckets (bytes, per target)
    and the tensors a broadcast already loaded into the model."""

    def __init__(self):
        self.staged: list[tuple[str, bytes]] = []
        self.counts: dict[str, int] = {}  # target -> tensors received (staged or direct)
        self.touched = False  # the model got some of it already (a broadcast, or the apply began)
        self.broadcast = False  # some of it came by the collective broadcast
        self.started = time.perf_counter()

    def add(self, target: str, tensors: int) -> None:
        self.counts[target] = self.counts.get(target, 0) + tensors


class EngineState:
    """Weight version and update session shared by the routes of one engine (``cfg`` validated:
    an adaptive spec's settings are resolved)."""

    def __init__(self, engine, cfg: RolloutConfig):
        self.engine = engine
        self.cfg = cfg
        self.version = 0
        self.session: UpdateSession | None = None
        # why the model holds partly loaded weights (None: it does not); paused while set
        self.dirty: str | None = None
        self.dirty_targets: set[str] = set()  # what a commit must carry to make the engine whole again
        self.paused_for_update = False
        self.active_target: str | None = None
        self.loaded: dict[str, int] = {}
        self.committed = {"rpc": 0, "broadcast": 0}  # updates committed, by how they came
        self.lock = asyncio.Lock()
        self.started = time.time()
        self.spec_k_file: str | None = os.environ.get(k_driver.ENV_FILE)
        self.spec_k = cfg.spec.k_at_start
        # vLLM fills CompletionOutput.spec_decode_metrics only where it has the flag (compat/vllm/features.py)
        self.per_request_spec = cfg.spec.enabled and vllm_version.has("per_request_spec_metrics")

    async def rpc(self, method: str, *args) -> list:
        return await self.engine.collective_rpc(method, args=args)

    async def switch_target(self, target: str | None) -> None:
        if self.active_target == target:
            return
        if self.active_target is not None:
            counts = await self.rpc("areal_finish_update", self.active_target)
            self.loaded[self.active_target] = int(counts[0])
        self.active_target = target
        if target is not None:
            await self.rpc("areal_begin_update", target)

    async def pause_for_update(self) -> None:
        if not self.paused_for_update:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            self.paused_for_update = True

    async def abandon(self, reason: str) -> None:
        """Drop the open session. Staged buckets never touched the model: the engine goes on as it
        was. Weights already loaded into the model (a broadcast, a failed apply) cannot be taken
        back: the workers' reload is closed, and the engine stays paused and dirty."""
        session, self.session = self.session, None
        if session is None:
            return
        if session.touched or self.active_target is not None:
            self.dirty = reason
            self.dirty_targets |= set(session.counts) | ({self.active_target} - {None})
            with contextlib.suppress(Exception):  # close the workers' reload; the weights stay dirty
                await self.switch_target(None)
            self.active_target = None
        elif self.paused_for_update and self.dirty is None:
            await self.engine.resume_generation()
            self.paused_for_update = False

    async def drop_stale_kv(self) -> None:
        """With prefix caching on, forget every KV block computed under the weights just replaced:
        called at a commit once the new weights are loaded, while generation is still paused.

        vLLM refuses to reset its prefix cache while requests hold blocks, and a ``keep`` pause holds
        the in-flight ones: ``reset_running_requests=True`` preempts them first (vLLM's own
        ``pause_generation(clear_cache=True)`` does the same), so after ``resume`` they recompute
        their prompt and the tokens generated so far under the new weights. Raises unless vLLM says
        the reset succeeded: the commit then fails and the engine stays paused (``weight_routes``)."""
        if not self.cfg.enable_prefix_caching:
            return  # nothing is shared between requests; in-flight ones keep their own KV (keep mode)
        done = await self.engine.reset_prefix_cache(reset_running_requests=True)
        if done is not True:
            raise RuntimeError(f"vLLM did not reset its prefix cache (answered {done!r}): stale KV is cached")

    def not_now(self) -> str:
        """Why generation is held (partly loaded weights, or an update loading)."""
        if self.dirty is not None:
            return f"the engine holds partly loaded weights ({self.dirty}); waiting for a complete update or a restart"
        return "a weight update is loading into the model; generation resumes at its commit"

    def status(self) -> dict:
        """``GET /areal/version``: the weight version, the update in progress, the draft length, vLLM."""
        return {
            "version": self.version,
            "updating": self.session is not None,
            "dirty": self.dirty,
            "committed": self.committed,
            "pid": os.getpid(),
            "spec": self.cfg.spec.vllm_dict(),
            "spec_k": self.spec_k,
            "uptime_s": time.time() - self.started,
            "vllm": vllm_features.summary(),
        }
