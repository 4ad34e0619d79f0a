"""Fault tolerance of the loop at the controller's seams (fast: a Protocol-only train engine, no engines).

* A workflow that keeps raising stops the run after ``controller.max_workflow_failures`` groups in a
  row -- instead of dropping groups and waiting for a batch forever -- with the workflow's error
  and the frame that raised it; a checkpoint of the last trained step is written when anything was
  trained. Failures that are not in a row never stop it.
* The weight sync serializes updates: an engine restarted during a push (the client's restart
  counter moved after the try that reached it) gets the new version again before the push returns,
  and a re-sync asked for meanwhile is left to the push (waiting for it could deadlock).

References: the budget and concurrency bound the number of workflow calls; the raising line is read
from this file's source; expected engine lists follow from which engine restarted when.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from areal_npu.algo.advantages import GRPOConfig
from areal_npu.config import ConfigError, validate_tree
from areal_npu.controller import ControllerConfig, RLController, WorkflowFailed
from areal_npu.data.trajectory import Trajectory
from areal_npu.rollout.client import WeightSyncError
from areal_npu.rollout.transports import WeightSync
from areal_npu.speculation.config import SpecConfig
from areal_npu.train.losses import PPOLoss
from tests.train.test_protocol import Client, Logger, OnlyTheProtocol, RecordingEngine

HANG_GUARD_S = 120  # a hang is the bug under test: fail instead of blocking the suite


def _controller(tmp_path, cfg: ControllerConfig):
    engine = RecordingEngine()
    controller = RLController(
        cfg, OnlyTheProtocol(engine), None, Client(), list(range(32)), tmp_path, Logger(), spec=SpecConfig(),
        grpo=GRPOConfig(), loss=PPOLoss(), seed=0,
    )  # fmt: skip
    return controller, engine


class Workflow:
    """``fail(n)`` decides whether call ``n`` raises; groups carry the version the engines serve."""

    def __init__(self, fail, controller=None):
        self.fail, self.calls, self.controller = fail, 0, controller

    async def run(self, task, client, group_id):
        n = self.calls
        self.calls += 1
        if self.fail(n):
            raise_broken_reward(n)
        version = self.controller.version if self.controller is not None else 0
        return [
            Trajectory([1, 2], [3, 4], [-0.5] * 2, [version] * 2, reward=float(i), group_id=group_id)
            for i in range(2)
        ]


def raise_broken_reward(n: int):
    raise ValueError(f"broken reward on call {n}")


def _raise_line() -> int:
    lines, start = inspect.getsourcelines(raise_broken_reward)
    return start + next(i for i, line in enumerate(lines) if "raise ValueError" in line)


def _run(controller, workflow):
    return asyncio.run(asyncio.wait_for(controller.run(workflow), HANG_GUARD_S))


@pytest.mark.parametrize("budget,concurrent", [(1, 1), (5, 3)])
def test_a_workflow_that_always_raises_stops_the_run_within_the_budget(tmp_path, budget, concurrent):
    cfg = ControllerConfig(
        steps=3, batch_groups=2, max_concurrent_groups=concurrent, max_workflow_failures=budget
    )
    controller, engine = _controller(tmp_path, cfg)
    workflow = Workflow(lambda n: True)
    with pytest.raises(WorkflowFailed) as err:
        _run(controller, workflow)
    # the budget-th failure stops admission; at most the other groups then in flight also ran
    assert budget <= workflow.calls <= budget + concurrent - 1
    message = str(err.value)
    assert f"failed on {budget} groups in a row" in message
    assert f"controller.max_workflow_failures={budget}" in message
    assert "ValueError: broken reward on call" in message
    assert f"{__file__}:{_raise_line()} in raise_broken_reward" in message
    assert isinstance(err.value.__cause__, ValueError)
    assert engine.calls == [] and "checkpoint" not in message  # nothing trained, nothing saved
    assert not controller.in_flight  # every group task ended


@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_failing_after_a_trained_step_saves_that_step_once(tmp_path, checkpoint_every):
    cfg = ControllerConfig(steps=4, batch_groups=2, max_concurrent_groups=2, max_workflow_failures=3,
                           checkpoint_every=checkpoint_every)  # fmt: skip
    controller, engine = _controller(tmp_path, cfg)
    workflow = Workflow(lambda n: n >= 2, controller)  # one step's groups, then only failures
    with pytest.raises(WorkflowFailed) as err:
        _run(controller, workflow)
    assert [c[0] for c in engine.calls].count("train_step") == 1
    saves = [c[2] for c in engine.calls if c[0] == "save_checkpoint"]
    assert saves == [{"step": 0}]  # written once: by the step itself (checkpoint_every=1) or at the stop
    assert "step 0 under" in str(err.value) and "--resume" in str(err.value)


def test_failures_that_are_not_in_a_row_never_stop_the_run(tmp_path):
    cfg = ControllerConfig(steps=3, batch_groups=2, max_concurrent_groups=1, max_workflow_failures=2,
                           checkpoint_every=0)  # fmt: skip
    controller, engine = _controller(tmp_path, cfg)
    workflow = Workflow(lambda n: n % 2 == 0, controller)  # fail, succeed, fail, ...: one in a row at most
    history = _run(controller, workflow)
    assert len(history) == 3
    failed = (workflow.calls + 1) // 2  # calls 0, 2, 4, ...
    assert controller.failures == failed >= 6  # each of the 6 trained groups came after a failure
    assert 6 <= history[-1]["rollout/failed_groups"] <= failed  # logged at the last step; more may follow


def test_a_crashed_producer_stops_the_trainer_instead_of_leaving_it_waiting(tmp_path):
    controller, _ = _controller(tmp_path, ControllerConfig(steps=2, batch_groups=2))

    class Crash(RuntimeError):
        pass

    def crash(version):
        raise Crash("gate broken")

    controller.gate.can_admit = crash
    with pytest.raises(Crash):
        _run(controller, Workflow(lambda n: False, controller))


def test_the_budget_is_validated_with_its_key():
    with pytest.raises(ConfigError) as err:
        validate_tree(ControllerConfig(max_workflow_failures=0), "controller.")
    assert err.value.key == "controller.max_workflow_failures"


# ---- the weight sync under restarts ---------------------------------------------------------------


class RestartingClient:
    """The client surface the sync reads: restart counters, and restarts of engines that are down."""

    def __init__(self, n: int):
        self.generation = [0] * n
        self.down: set[int] = set()

    async def recover_engine(self, i):
        if i in self.down:
            self.down.discard(i)
            self.generation[i] += 1
            return True
        return False


class ScriptedTransport:
    """Runs ``during(call_index, engines)`` inside each update, then commits (or fails) as scripted."""

    name = "fake"

    def __init__(self, n: int, during=None, failures=()):
        self.n, self.during, self.failures = n, during, list(failures)
        self.asked: list[tuple[list[int], int]] = []

    async def update(self, named, version, *, sync_draft=True, engines=None):
        order = list(range(self.n)) if engines is None else sorted(engines)
        self.asked.append((order, version))
        if self.during is not None:
            await self.during(len(self.asked) - 1, order)
        failing = self.failures.pop(0) if self.failures else {}
        if failing:
            raise WeightSyncError(version, failing, [i for i in order if i not in failing])
        return {"version": version, "engines": order}


def test_an_engine_restarted_during_a_push_gets_the_new_version_again():
    client = RestartingClient(2)
    sync: WeightSync

    async def during(call, engines):
        if call == 0:  # a generation noticed engine 1 down and restarted it while the push ran
            client.generation[1] += 1
            assert (await sync.resync(1, [("w", torch.zeros(1))], 4))["deferred"]  # its on_restart

    transport = ScriptedTransport(2, during)
    sync = WeightSync(transport, client, retries=2)
    result = asyncio.run(sync.push([("w", torch.ones(1))], 5))
    assert transport.asked == [([0, 1], 5), ([1], 5)]  # everyone, then the restarted engine once more
    assert result["tries"] == 2 and "restarted during the sync" in result["failures"][0]


def test_an_engine_killed_mid_push_is_restarted_and_only_it_is_resent():
    client = RestartingClient(2)
    client.down = {0}
    transport = ScriptedTransport(2, failures=[{0: "connection reset"}])
    result = asyncio.run(WeightSync(transport, client, retries=2).push([("w", torch.ones(1))], 3))
    # the restart happened between the tries: the second try reaches the restarted engine, no third
    assert transport.asked == [([0, 1], 3), ([0], 3)] and result["restarted"] == [0]


def test_a_resync_after_a_push_sends_the_newest_weights():
    client = RestartingClient(1)
    transport = ScriptedTransport(1)
    sync = WeightSync(transport, client)

    async def go():
        await sync.push([("w", torch.ones(1))], 2)
        return await sync.resync(0, [("w", torch.zeros(1))], 1)  # asked with what it read earlier

    assert asyncio.run(go())["version"] == 2 and transport.asked[-1] == ([0], 2)


def test_resyncs_outside_a_push_run_one_at_a_time():
    client = RestartingClient(2)
    active, overlaps = [0], []

    async def during(call, engines):
        active[0] += 1
        overlaps.append(active[0])
        await asyncio.sleep(0.01)
        active[0] -= 1

    transport = ScriptedTransport(2, during)
    sync = WeightSync(transport, client)

    async def go():
        await asyncio.gather(*(sync.resync(i, [("w", torch.ones(1))], 1) for i in (0, 1, 0)))

    asyncio.run(go())
    assert overlaps == [1, 1, 1] and len(transport.asked) == 3


def test_an_engine_down_at_the_step_metrics_is_left_out_instead_of_failing_the_step():
    """The trainer reads the engines' counters after every push; an engine restarting then (it died
    mid-generation) must not fail the step. Reference: the counters of the engine that answers."""
    from tests.rollout.test_client import Engines, client_for

    engines = Engines(["a", "b"])
    engines.down.add("b")

    async def run():
        async with client_for(engines, ["http://a", "http://b"]) as client:
            return await client.counters(), await client.step_metrics()

    total, stats = asyncio.run(run())
    assert (total.drafts, total.accepted, total.generation_tokens) == (10, 15, 40)  # engine a's alone
    assert stats["rollout/spec_accept_rate"] == 15 / 20
