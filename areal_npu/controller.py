"""The asynchronous RL loop: workflows generate continuously, the trainer consumes fixed-size batches.

    producers:  task -> workflow (vLLM engines, sandbox reward) -> group of trajectories -> buffer
                (admitted only while the staleness bound allows: areal_npu.staleness)
    trainer:    B groups -> GRPO advantages -> proximal log-probs -> decoupled PPO (+ MTP) step
                -> push policy AND draft weights (pause, update, version+1, resume) -> metrics

Faults: a group whose workflow raises is dropped; ``controller.max_workflow_failures`` of them in a
row stop the run (:class:`WorkflowFailed`, after a checkpoint of the last trained step) instead of
leaving the trainer waiting for a batch that never fills. An engine that dies is restarted by the
client, which re-issues its requests and, through :meth:`RLController.resync_engine`, brings it to
the weights the others serve; its tokens carry the version it really holds (the checkpoint it
restarted from until then), so the staleness check at consumption judges them honestly. Weights
travel as a stream from the trainer's export (:func:`exported`): the controller keeps no copy.

Phase times are measured every step (:data:`areal_npu.names.PHASES`): T_gen (waiting for the
batch), T_prox, T_train, T_sync; and the workflows' time (``reward``, a side phase).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from areal_npu import names
from areal_npu.agent.tasks import format_prompt
from areal_npu.algo.advantages import GRPOConfig, grpo_advantages
from areal_npu.data.sample import TrainSample
from areal_npu.data.trajectory import Trajectory, training_sample
from areal_npu.speculation.config import SpecConfig
from areal_npu.staleness import StalenessGate
from areal_npu.train.losses import Loss
from areal_npu.train.protocol import TrainEngine


@dataclass
class ControllerConfig:
    steps: int = 20  # RL training steps
    batch_groups: int = 8  # prompt groups per step (each group_size trajectories)
    max_staleness: int = 1  # 0: synchronous RL
    max_concurrent_groups: int = 16
    checkpoint_every: int = 5  # 0: only at the end
    eval_every: int = (
        0  # held-out eval (one sample per prompt) every N steps, before step 0 and at the end; 0: off
    )
    eval_size: int = 128  # held-out prompts per eval (from the task's eval split)
    # the run stops (checkpoint, error, non-zero exit) after this many groups in a row whose workflow
    # raised; a group that finishes resets the count. Above max_concurrent_groups, so one engine
    # failure that fails every group in flight does not stop the run
    max_workflow_failures: int = 64

    def validate(self) -> None:
        for key in ("steps", "batch_groups", "max_concurrent_groups"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 (0 is synchronous RL)")
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        if self.eval_every < 0 or self.eval_size < 1:
            raise ValueError("eval_every must be >= 0 and eval_size >= 1")
        if self.max_workflow_failures < 1:
            raise ValueError("max_workflow_failures must be >= 1 (a failing workflow stops the run)")


class WorkflowFailed(RuntimeError):
    """The workflow raised on ``controller.max_workflow_failures`` groups in a row: the run stops
    instead of generating and dropping groups forever (the trainer would wait for a batch that
    never fills). Names the last exception and the frame that raised it."""

    def __init__(self, failures: int, budget: int, exc: BaseException, saved: str | None = None):
        self.failures, self.budget, self.exc = failures, budget, exc
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        stop = " -- the run stops"
        if saved:
            stop += f"; the trainer's {saved} (--resume continues from it)"
        super().__init__(
            f"the workflow failed on {failures} groups in a row (controller.max_workflow_failures={budget}); "
            f"the last: {type(exc).__name__}: {exc}{where}{stop}"
        )


class RLController:
    """``cfg`` is the loop's own config; ``engine`` a :class:`areal_npu.train.protocol.TrainEngine`
    (nothing beyond it is used) and ``loss`` the step's loss object
    (:class:`areal_npu.train.losses.PPOLoss`); ``spec`` the engines' speculative decoding (its
    ``sync_draft`` already resolved by the recipe: whether weight pushes carry the drafter);
    ``seed`` orders the tasks. The weight-push buckets are the transport's client's
    (``rollout.weight_bucket_bytes``)."""

    def __init__(
        self,
        cfg: ControllerConfig,
        engine: TrainEngine,
        tokenizer,
        client,
        tasks: list,
        run_dir: Path,
        logger,
        *,
        spec: SpecConfig,
        grpo: GRPOConfig,
        loss: Loss,
        seed: int,
        start_step: int = 0,
        eval_tasks: list | None = None,
        weight_sync=None,  # rollout.transports.WeightSync; default: RPC buckets, 2 retries
    ):
        self.cfg = cfg
        self.spec = spec
        self.grpo = grpo
        self.loss = loss
        self.engine = engine
        self.tokenizer = tokenizer
        self.client = client
        if weight_sync is None:
            from areal_npu.rollout.transports import RpcTransport, WeightSync

            weight_sync = WeightSync(RpcTransport(client), client)
        self.weight_sync = weight_sync
        self.tasks = tasks
        self.eval_tasks = (eval_tasks or [])[: cfg.eval_size]
        self.run_dir = run_dir
        self.logger = logger
        self.start_step = start_step
        self.gate = StalenessGate.resumed(cfg.batch_groups, cfg.max_staleness, start_step)
        self.version = engine.version  # what the rollout engines serve
        self.buffer: deque = deque()
        self.buffer_event = asyncio.Event()
        self.version_event = asyncio.Event()
        self.in_flight: set[asyncio.Task] = set()
        self.failures = 0
        self.failures_in_a_row = 0
        self.fatal: BaseException | None = None  # stops the trainer at its next wait (next_batch)
        self.saved_step: int | None = None  # the step of the last checkpoint written
        self.reward_time = 0.0
        self.order = list(range(len(tasks)))
        random.Random(seed).shuffle(self.order)
        self.next_task = start_step * cfg.batch_groups  # data position
        self.sync_draft = spec.sync_draft
        self.pushed = False  # the engines serve a pushed version (re-syncs stream the trainer's again)
        self.resyncs = 0  # restarted engines brought to the trainer's weights
        self.training = False  # the trainer computes, pushes or saves (trainer_phase)
        self.trainer_busy = asyncio.Lock()  # held by the trainer's phases and by a re-sync
        self.spec_driver = None
        if spec.enabled and spec.adaptive:
            from areal_npu.speculation.adaptive import AdaptiveSpecDriver

            self.spec_driver = AdaptiveSpecDriver(
                client, spec.adapt_settings, log=logger.print, decisions_path=run_dir / "spec_decisions.jsonl"
            )

    # ---- producers ------------------------------------------------------------------------------
    async def _run_group(self, workflow, index: int, version: int) -> None:
        task = self.tasks[self.order[index % len(self.order)]]
        start = time.perf_counter()
        try:
            group = await workflow.run(task, self.client, group_id=index)
        except Exception as exc:  # noqa: BLE001 - one failed group must not stop the run; many in a row do
            self.failures += 1
            self.failures_in_a_row += 1
            self.gate.drop()
            self.logger.print(f"group {index} failed and is dropped: {exc}")
            if self.failures_in_a_row >= self.cfg.max_workflow_failures and self.fatal is None:
                self._stop(WorkflowFailed(self.failures_in_a_row, self.cfg.max_workflow_failures, exc))
            self.version_event.set()
            return
        self.failures_in_a_row = 0
        self.reward_time += time.perf_counter() - start
        self.buffer.append((version, group))
        self.buffer_event.set()

    async def produce(self, workflow) -> None:
        limit = self.cfg.max_concurrent_groups
        while self.fatal is None:
            while self.gate.can_admit(self.version) and len(self.in_flight) < limit and self.fatal is None:
                self.gate.admit()
                task = asyncio.create_task(self._run_group(workflow, self.next_task, self.version))
                self.next_task += 1
                self.in_flight.add(task)
                task.add_done_callback(self._on_done)
            self.version_event.clear()
            await self.version_event.wait()

    def _on_done(self, task: asyncio.Task) -> None:
        self.in_flight.discard(task)
        self.version_event.set()

    def _stop(self, error: BaseException) -> None:
        """Make the trainer raise ``error`` at its next wait for groups; the producer stops admitting."""
        self.fatal = error
        self.buffer_event.set()

    def _producer_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.fatal is None:
            self._stop(task.exception())  # a crashed producer would leave the trainer waiting forever

    # ---- trainer --------------------------------------------------------------------------------
    async def next_batch(self, step: int) -> tuple[list[list[Trajectory]], dict]:
        groups: list[list[Trajectory]] = []
        stale_dropped = 0
        while len(groups) < self.cfg.batch_groups:
            if self.fatal is not None:
                raise self.fatal
            while not self.buffer:
                if self.fatal is not None:
                    raise self.fatal
                self.buffer_event.clear()
                await self.buffer_event.wait()
            version, group = self.buffer.popleft()
            if all(self.gate.fresh_enough(step, t.oldest_version()) for t in group):
                groups.append(group)
                self.gate.consume()
            else:
                stale_dropped += 1
                self.gate.drop()
            self.version_event.set()
        return groups, {names.STALE_DROPPED_GROUPS: float(stale_dropped)}

    def _samples(self, groups: list[list[Trajectory]], step: int) -> tuple[list[TrainSample], dict]:
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([t.reward for t in flat], dtype=torch.float32)
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise RuntimeError(f"groups of unequal size {sorted(sizes)} at step {step}")
        adv, adv_stats = grpo_advantages(rewards, sizes.pop(), std_normalize=self.grpo.std_normalize)
        lags = [step - v for t in flat for v, m in zip(t.versions, t.response_mask()) if m and v >= 0]
        reasons: dict[str, float] = {}
        episode: dict[str, list[float]] = {}  # a workflow's per-episode numbers (meta["stats"])
        for t in flat:
            key = names.reward_reason_key(t.meta.get("reason", "unknown"))
            reasons[key] = reasons.get(key, 0.0) + 1.0
            if "env_backend" in t.meta:  # recorded per episode: what isolation the step really had
                key = names.env_backend_key(t.meta["env_backend"])
                reasons[key] = reasons.get(key, 0.0) + 1.0
            for name, value in t.meta.get("stats", {}).items():
                episode.setdefault(names.episode_key(name), []).append(float(value))
        suspicious = episode.pop(names.episode_key(names.SUSPICIOUS_STAT), None)  # logged as a reward stat
        stats = {
            names.REWARD_MEAN: float(rewards.mean()),
            names.REWARD_MIN: float(rewards.min()),
            names.REWARD_MAX: float(rewards.max()),
            names.REWARD_SOLVED: float((rewards >= 1).float().mean()),
            names.STALENESS_MAX: float(max(lags, default=0)),
            names.STALENESS_MEAN: sum(lags) / max(1, len(lags)),
            names.RESPONSE_LEN: sum(len(t.response_ids) for t in flat) / len(flat),
            **{k: float(v) for k, v in adv_stats.items()},
            **reasons,
            **{k: sum(v) / len(v) for k, v in episode.items()},
            **{
                names.episode_p95_key(n): float(np.percentile(episode[names.episode_key(n)], 95))
                for n in names.LATENCY_STATS
                if names.episode_key(n) in episode
            },  # fmt: skip
        }
        if suspicious:
            stats[names.REWARD_SUSPICIOUS] = sum(suspicious) / len(suspicious)
        # an episode's earlier segments (its harness rewrote the history) share its advantage
        return [training_sample(s, float(a)) for t, a in zip(flat, adv) for s in (*t.segments, t)], stats

    async def push_weights(self, step: int | None = None) -> float:
        """The trainer's weights to every engine through the weight transport (``self.weight_sync``:
        failed engines restarted and re-synced, bounded retries). When that fails for good, the
        trainer's weights of ``step`` are saved as its checkpoint and the run stops with the error."""
        from areal_npu.rollout.transports import WeightSyncFailed

        start = time.perf_counter()
        named = exported(self.engine)
        try:
            await self.weight_sync.push(named, self.engine.version, sync_draft=self.sync_draft)
        except WeightSyncFailed as exc:
            if step is None:
                raise
            checkpoints = self.run_dir / "checkpoints"
            await asyncio.to_thread(self.engine.save_checkpoint, checkpoints, {"step": step}, self.tokenizer)
            raise WeightSyncFailed(
                exc.version, exc.attempts, exc.retries, saved=f"step {step} under {checkpoints}"
            ) from exc
        self.pushed = True
        self.version = self.engine.version
        self.version_event.set()
        return time.perf_counter() - start

    @contextlib.asynccontextmanager
    async def trainer_phase(self):
        """The trainer computes, pushes or saves: from now re-syncs read nothing (the step's push
        covers them); one that streams already is waited for."""
        self.training = True
        try:
            async with self.trainer_busy:
                yield
        finally:
            self.training = False

    async def resync_engine(self, i: int) -> None:
        """For ``RolloutClient(on_restart=...)``: a restarted engine serves the checkpoint it started
        from; bring it to the weights the other engines serve (nothing to do before the first push),
        streamed from the trainer's export again. Only while the trainer waits for its batch: its
        weights are then the version the engines serve. While it computes, pushes or saves, nothing
        here (waiting would hold the engine's restart lock, which the push may need): the push that
        ends the step reaches every engine, this one included. Re-syncs of several engines take
        turns (none of them waits for the trainer, so waiting for one cannot deadlock)."""
        if not self.pushed:
            return
        while self.trainer_busy.locked():
            if self.training:
                return
            await asyncio.sleep(0.05)  # another engine's re-sync streams
        if self.training:
            return
        async with self.trainer_busy:
            await self.weight_sync.resync(i, exported(self.engine), self.version, sync_draft=self.sync_draft)
        self.resyncs += 1
        if self.logger is not None:
            self.logger.print(f"engine {i} restarted: re-synced to version {self.version}")

    async def evaluate(self, workflow) -> dict[str, float]:
        """Mean reward of one sample (one episode) per held-out task under the weights the engines
        serve now. A task whose generation or grading fails is counted in ``eval/failed`` and left
        out of the means: an eval never stops the run. A workflow with ``eval_episode(task, client)``
        (numbers by name, ``reward`` among them) runs its own episodes; each is logged as ``eval/<name>``."""
        if not self.eval_tasks:
            return {}
        start = time.perf_counter()
        if hasattr(workflow, "eval_episode"):
            episodes = (workflow.eval_episode(t, self.client) for t in self.eval_tasks)
            results = list(await asyncio.gather(*episodes, return_exceptions=True))
        else:
            results = await self._eval_single_turn(workflow)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # cancellation is not an eval failure
        failed = [r for r in results if isinstance(r, Exception)]
        done = [r for r in results if not isinstance(r, Exception)]
        if failed:
            self.logger.print(f"eval: {len(failed)} of {len(results)} tasks failed, left out: {failed[0]}")
        out = {names.EVAL_FAILED: float(len(failed)), names.timing_key("eval"): time.perf_counter() - start}
        if done:
            for name in done[0]:
                out[names.eval_key(name)] = sum(float(r[name]) for r in done) / len(done)
            out[names.EVAL_SOLVED] = sum(r["reward"] >= 1 for r in done) / len(done)
        return out

    async def _eval_single_turn(self, workflow) -> list:
        """Per eval task ``{"reward": r}`` or the exception, for a workflow with sample() and grade()."""
        prompts = [workflow.encode(format_prompt(t)) for t in self.eval_tasks]
        samples = (workflow.sample(self.client, p, 1) for p in prompts)
        results: list = list(await asyncio.gather(*samples, return_exceptions=True))
        ok = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        if ok:
            try:
                graded = await workflow.grade([self.eval_tasks[i] for i in ok], [results[i][0] for i in ok])
            except Exception as exc:  # noqa: BLE001 - a broken grader fails this eval, not the run
                graded = [exc] * len(ok)
            for i, g in zip(ok, graded):
                results[i] = g if isinstance(g, Exception) else {"reward": g[0]}
        return results

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step == 0 or (step + 1) % every == 0 or step + 1 == self.cfg.steps)

    async def train(self, on_step=None, workflow=None) -> list[dict]:
        from areal_npu.speculation.planner import live_perf_metrics

        c = self.cfg
        history = []
        if self.spec_driver is not None:
            await self.spec_driver.start()
        await self.client.step_metrics()  # start the counter deltas here
        for step in range(self.start_step, c.steps):
            eval_stats = {}
            if workflow is not None and step == 0 and self._eval_due(0):
                eval_stats = await self.evaluate(workflow)  # the starting point, before any update
            t0 = time.perf_counter()
            self.reward_time = 0.0
            try:
                groups, stats = await self.next_batch(step)
            except WorkflowFailed as exc:
                raise await self._stopped_by(exc, step) from exc.exc
            t_gen = time.perf_counter() - t0
            samples, batch_stats = self._samples(groups, step)
            stats.update(batch_stats)
            async with self.trainer_phase():
                t1 = time.perf_counter()
                prox = await asyncio.to_thread(self.engine.compute_logprobs, samples)
                for s, lp in zip(samples, prox):
                    s.prox_logp = lp
                t2 = time.perf_counter()
                stats.update(await asyncio.to_thread(self.engine.train_step, samples, self.loss, step))
                t3 = time.perf_counter()
                t_sync = await self.push_weights(step)
            stats.update(await self.client.step_metrics())
            spec_k = self.spec.k_at_start  # the driver, where there is one, changes it between steps
            if self.spec_driver is not None:
                stats.update(await self.spec_driver.step(step, stats))
                spec_k = int(stats[names.SPEC_K])
            stats.update(
                {
                    names.timing_key("gen"): t_gen,
                    names.timing_key("prox"): t2 - t1,
                    names.timing_key("train"): t3 - t2,
                    names.timing_key("sync"): t_sync,
                    names.timing_key("reward"): self.reward_time,
                    names.STEP_TIME: time.perf_counter() - t0,
                    names.EPISODES_PER_MIN: 60.0 * len(samples) / max(1e-9, time.perf_counter() - t0),
                }
            )
            stats.update(live_perf_metrics(stats, spec_k=spec_k))
            stats.update({names.FAILED_GROUPS: float(self.failures), names.VERSION: float(self.version),
                          names.ENGINE_RESTARTS: float(sum(self.client.generation)),
                          names.ENGINE_RESYNCS: float(self.resyncs)})  # fmt: skip
            if workflow is not None and step > 0 and self._eval_due(step):
                eval_stats = await self.evaluate(workflow)  # after the push: this step's new weights
            stats.update(eval_stats)
            if c.checkpoint_every and ((step + 1) % c.checkpoint_every == 0 or step + 1 == c.steps):
                checkpoints = self.run_dir / "checkpoints"
                async with self.trainer_phase():
                    await asyncio.to_thread(
                        self.engine.save_checkpoint, checkpoints, {"step": step}, self.tokenizer
                    )
                self.saved_step = step
            self.logger.log(step, stats)
            history.append(stats)
            if on_step is not None:
                on_step(step, stats)
        return history

    async def _stopped_by(self, exc: WorkflowFailed, step: int) -> WorkflowFailed:
        """``exc`` with where the trainer's last weights were saved: a checkpoint of the last step
        trained in this run (written now unless the step's own checkpoint holds it)."""
        last = step - 1
        if last < self.start_step:
            return exc
        checkpoints = self.run_dir / "checkpoints"
        if self.saved_step != last:
            async with self.trainer_phase():
                await asyncio.to_thread(
                    self.engine.save_checkpoint, checkpoints, {"step": last}, self.tokenizer
                )
        return WorkflowFailed(exc.failures, exc.budget, exc.exc, saved=f"step {last} under {checkpoints}")

    async def run(self, workflow, on_step=None) -> list[dict]:
        producer = asyncio.create_task(self.produce(workflow))
        producer.add_done_callback(self._producer_done)
        try:
            return await self.train(on_step, workflow)
        finally:
            producer.cancel()
            for task in list(self.in_flight):
                task.cancel()
            await asyncio.gather(producer, *self.in_flight, return_exceptions=True)


def exported(engine: TrainEngine):
    """The trainer's weights for a sync, as a :class:`~areal_npu.rollout.weight_stream.WeightStream`
    of its ``export_buckets``: each iteration gathers them again. Tensor by tensor (export buckets of
    one): the transport makes the buckets it sends, so one bucket is alive, not that one and the
    export's next."""
    from areal_npu.rollout.weight_stream import WeightStream

    return WeightStream(lambda: (pair for _, bucket in engine.export_buckets(1) for pair in bucket))
