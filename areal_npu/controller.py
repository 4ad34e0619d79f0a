"""The asynchronous RL loop: workflows generate continuously, the trainer consumes fixed-size batches.

    producers:  task -> workflow (vLLM engines, sandbox reward) -> group of trajectories -> buffer
                (admitted only while the staleness bound allows: areal_npu.staleness)
    trainer:    B groups -> GRPO advantages -> proximal log-probs -> decoupled PPO (+ MTP) step
                -> push policy AND draft weights (pause, update, version+1, resume) -> metrics

Phase times are measured every step: T_gen (waiting for the batch), T_prox, T_train, T_sync, and
the reward time spent inside the workflows.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from pathlib import Path

import torch

from areal_npu.agent.tasks import format_prompt
from areal_npu.algo.advantages import grpo_advantages
from areal_npu.data.trajectory import Trajectory, sft_sample, training_sample
from areal_npu.recipe import RLConfig
from areal_npu.staleness import StalenessGate


class RLController:
    def __init__(
        self,
        cfg: RLConfig,
        engine,
        tokenizer,
        client,
        tasks: list,
        run_dir: Path,
        logger,
        start_step: int = 0,
        eval_tasks: list | None = None,
    ):
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.client = client
        self.tasks = tasks
        self.eval_tasks = (eval_tasks or [])[: cfg.controller.eval_size]
        self.run_dir = run_dir
        self.logger = logger
        self.start_step = start_step
        c = cfg.controller
        self.gate = StalenessGate.resumed(c.batch_groups, c.max_staleness, start_step)
        self.version = engine.version  # what the rollout engines serve
        self.buffer: deque = deque()
        self.buffer_event = asyncio.Event()
        self.version_event = asyncio.Event()
        self.in_flight: set[asyncio.Task] = set()
        self.failures = 0
        self.reward_time = 0.0
        self.order = list(range(len(tasks)))
        random.Random(cfg.seed).shuffle(self.order)
        self.next_task = start_step * c.batch_groups  # data position
        spec = cfg.rollout.spec
        # the drafter is updated only when it is our MTP head and that head trains
        self.sync_draft = spec.enabled and spec.is_mtp and spec.sync_draft and cfg.mtp.enabled and cfg.mtp.train
        self.last_named: list | None = None  # the last pushed weights, for engines that restart
        self.spec_driver = None
        if spec.enabled and spec.adaptive:
            from areal_npu.rollout.adaptive import AdaptiveSpecDriver

            self.spec_driver = AdaptiveSpecDriver(
                client, spec.adapt_config(), log=logger.print, decisions_path=run_dir / "spec_decisions.jsonl"
            )

    # ---- producers ------------------------------------------------------------------------------
    async def _run_group(self, workflow, index: int, version: int) -> None:
        task = self.tasks[self.order[index % len(self.order)]]
        start = time.perf_counter()
        try:
            group = await workflow.run(task, self.client, group_id=index)
        except Exception as exc:  # noqa: BLE001 - one failed group must not stop the run
            self.failures += 1
            self.gate.drop()
            self.logger.print(f"group {index} failed and is dropped: {exc}")
            self.version_event.set()
            return
        self.reward_time += time.perf_counter() - start
        self.buffer.append((version, group))
        self.buffer_event.set()

    async def produce(self, workflow) -> None:
        limit = self.cfg.controller.max_concurrent_groups
        while True:
            while self.gate.can_admit(self.version) and len(self.in_flight) < limit:
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

    # ---- trainer --------------------------------------------------------------------------------
    async def next_batch(self, step: int) -> tuple[list[list[Trajectory]], dict]:
        groups: list[list[Trajectory]] = []
        stale_dropped = 0
        while len(groups) < self.cfg.controller.batch_groups:
            while not self.buffer:
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
        return groups, {"staleness/dropped_groups": float(stale_dropped)}

    def _samples(self, groups: list[list[Trajectory]], step: int) -> tuple[list[dict], dict]:
        flat = [t for g in groups for t in g]
        rewards = torch.tensor([t.reward for t in flat], dtype=torch.float32)
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise RuntimeError(f"groups of unequal size {sorted(sizes)} at step {step}")
        adv, adv_stats = grpo_advantages(rewards, sizes.pop(), std_normalize=self.cfg.grpo.std_normalize)
        lags = [step - v for t in flat for v, m in zip(t.versions, t.response_mask()) if m and v >= 0]
        reasons: dict[str, float] = {}
        for t in flat:
            key = f"reward/reason_{t.meta.get('reason', 'unknown')}"
            reasons[key] = reasons.get(key, 0.0) + 1.0
        stats = {
            "reward/mean": float(rewards.mean()),
            "reward/min": float(rewards.min()),
            "reward/max": float(rewards.max()),
            "reward/solved": float((rewards >= 1).float().mean()),
            "staleness/max": float(max(lags, default=0)),
            "staleness/mean": sum(lags) / max(1, len(lags)),
            "rollout/response_len": sum(len(t.response_ids) for t in flat) / len(flat),
            **{k: float(v) for k, v in adv_stats.items()},
            **reasons,
        }
        return [training_sample(t, float(a)) for t, a in zip(flat, adv)], stats

    async def push_weights(self) -> float:
        start = time.perf_counter()
        named = [
            pair
            for _, bucket in self.engine.export_buckets(self.cfg.rollout.weight_bucket_bytes)
            for pair in bucket
        ]
        await self.client.update_weights(named, self.engine.version, sync_draft=self.sync_draft)
        self.last_named = named
        self.version = self.engine.version
        self.version_event.set()
        return time.perf_counter() - start

    async def evaluate(self, workflow) -> dict[str, float]:
        """Mean reward of one sample per held-out prompt under the weights the engines serve now."""
        if not self.eval_tasks:
            return {}
        start = time.perf_counter()
        prompts = [workflow.encode(format_prompt(t)) for t in self.eval_tasks]
        results = await asyncio.gather(*(workflow.sample(self.client, p, 1) for p in prompts))
        graded = await workflow.grade(self.eval_tasks, [r[0] for r in results])
        rewards = [r for r, _ in graded]
        return {"eval/reward": sum(rewards) / len(rewards),
                "eval/solved": sum(r >= 1 for r in rewards) / len(rewards),
                "timing/eval_s": time.perf_counter() - start}

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.controller.eval_every
        return bool(every) and (step == 0 or (step + 1) % every == 0 or step + 1 == self.cfg.controller.steps)

    async def train(self, on_step=None, workflow=None) -> list[dict]:
        from areal_npu.planner import live_perf_metrics
        from areal_npu.train.checkpoint import save_checkpoint

        c = self.cfg.controller
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
            groups, stats = await self.next_batch(step)
            t_gen = time.perf_counter() - t0
            samples, batch_stats = self._samples(groups, step)
            stats.update(batch_stats)
            t1 = time.perf_counter()
            prox = await asyncio.to_thread(self.engine.compute_logprobs, samples)
            for s, lp in zip(samples, prox):
                s["prox_logp"] = lp
            t2 = time.perf_counter()
            stats.update(await asyncio.to_thread(self.engine.train_step, samples, "ppo", step))
            t3 = time.perf_counter()
            t_sync = await self.push_weights()
            stats.update(await self.client.step_metrics())
            spec_k = self.cfg.rollout.spec.num_speculative_tokens if self.cfg.rollout.spec.enabled else 0
            if self.spec_driver is not None:
                stats.update(await self.spec_driver.step(step, stats))
                spec_k = int(stats["rollout/spec_k"])
            timings = {
                "timing/gen_s": t_gen,
                "timing/prox_s": t2 - t1,
                "timing/train_s": t3 - t2,
                "timing/sync_s": t_sync,
                "timing/reward_s": self.reward_time,
                "timing/step_s": time.perf_counter() - t0,
            }
            stats.update(timings)
            counters = {
                "spec_decode_num_drafts": stats.get("rollout/spec_drafts", 0.0),
                "spec_decode_num_draft_tokens": stats.get("rollout/spec_draft_tokens", 0.0),
                "spec_decode_num_accepted_tokens": stats.get("rollout/spec_accepted_tokens", 0.0),
            }
            stats.update(live_perf_metrics(timings, spec_k=spec_k, spec_counters=counters))
            stats.update(
                {"rollout/failed_groups": float(self.failures), "rollout/version": float(self.version)}
            )
            if workflow is not None and step > 0 and self._eval_due(step):
                eval_stats = await self.evaluate(workflow)  # after the push: this step's new weights
            stats.update(eval_stats)
            if c.checkpoint_every and ((step + 1) % c.checkpoint_every == 0 or step + 1 == c.steps):
                await asyncio.to_thread(
                    save_checkpoint, self.engine, self.run_dir / "checkpoints", {"step": step}, self.tokenizer
                )
            self.logger.log(step, stats)
            history.append(stats)
            if on_step is not None:
                on_step(step, stats)
        return history

    async def run(self, workflow, on_step=None) -> list[dict]:
        producer = asyncio.create_task(self.produce(workflow))
        try:
            return await self.train(on_step, workflow)
        finally:
            producer.cancel()
            for task in list(self.in_flight):
                task.cancel()
            await asyncio.gather(producer, *self.in_flight, return_exceptions=True)


def warm_start_samples(tokenizer, pairs: list[tuple[str, str]]) -> list[dict]:
    return [
        sft_sample(
            tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(a, add_special_tokens=False)
        )
        for p, a in pairs
    ]
