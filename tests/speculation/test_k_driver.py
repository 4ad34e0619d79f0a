"""Runtime draft length on the engine side: control file, scheduler hook, config (no engine).

The engine-level behaviour (vLLM really drafts k tokens after ``POST /areal/spec_k``) is in
``tests/rollout/test_adaptive_engine.py``; the trainer-side driver in ``test_adaptive.py``.
"""

from __future__ import annotations

import importlib
import json
import os
from types import SimpleNamespace

import pytest

from areal_npu.config import ConfigError
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation import k_driver
from areal_npu.speculation.config import SpecConfig
from areal_npu.speculation.policy import SpecAdaptConfig


def test_the_engines_control_file_lives_as_long_as_the_block(monkeypatch):
    from areal_npu.compat.vllm import spec_off

    monkeypatch.delenv(k_driver.ENV_FILE, raising=False)
    monkeypatch.delenv(spec_off.SKIP_ENV, raising=False)
    with k_driver.control_file(2, keep_drafter_kv=True) as path:
        assert os.environ[k_driver.ENV_FILE] == str(path) and k_driver.read_k(path) == 2
        assert spec_off.SKIP_ENV not in os.environ
    assert not path.parent.exists()
    with k_driver.control_file(0, keep_drafter_kv=False) as path:
        assert os.environ[spec_off.SKIP_ENV] == "1" and k_driver.read_k(path) == 0
    assert not path.parent.exists()


def test_control_file_round_trip_is_atomic(tmp_path):
    path = tmp_path / "k"
    assert k_driver.read_k(path) is None
    for k in (3, 0, 2):
        k_driver.write_k(path, k)
        assert k_driver.read_k(path) == k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]  # no temporary left behind
    path.write_text("garbage\n")
    assert k_driver.read_k(path) is None


class FakeScheduler:
    """vLLM's Scheduler surface the mixin touches: num_spec_tokens, max_num_seqs, schedule()."""

    def __init__(self, num_spec_tokens=3, max_num_seqs=4):
        self.num_spec_tokens = num_spec_tokens
        self.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.dynamic_sd_lookup = None
        self.calls = 0

    def schedule(self):
        """Like vLLM: the K of this step is the table's entry for the batch size (here 1)."""
        self.calls += 1
        table = list(self.dynamic_sd_lookup) if self.dynamic_sd_lookup is not None else None
        k = table[1] if table is not None else self.num_spec_tokens
        return SimpleNamespace(table=table, num_spec_tokens_to_schedule=k)


class HookedScheduler(k_driver._RuntimeK, FakeScheduler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._areal_init_runtime_k()


def test_scheduler_applies_the_file_before_each_step_and_clamps(tmp_path, monkeypatch):
    path = tmp_path / "k"
    k_driver.write_k(path, 2)
    monkeypatch.setenv(k_driver.ENV_FILE, str(path))
    sched = HookedScheduler(num_spec_tokens=3, max_num_seqs=4)
    assert sched.schedule().table == [2] * 5  # index = batch size, 0..max_num_seqs
    assert sched.areal_last_k == 2
    k_driver.write_k(path, 0)
    os.utime(path, ns=(1, 1))  # the same modification time twice: content decides, not the clock
    assert sched.schedule().table == [0] * 5 and sched.areal_spec_k == 0 and sched.areal_last_k == 0
    k_driver.write_k(path, 9)  # above the engine's num_speculative_tokens
    os.utime(path, ns=(1, 1))
    assert sched.schedule().table == [3] * 5 and sched.areal_spec_k == 3 and sched.areal_last_k == 3
    assert sched.calls == 3


def test_scheduler_without_control_file_keeps_vllm_behaviour(monkeypatch):
    monkeypatch.delenv(k_driver.ENV_FILE, raising=False)
    sched = HookedScheduler()
    assert sched.schedule().table is None and sched.areal_spec_k == 3 and sched.areal_last_k == 3


def test_factory_extends_the_scheduler_vllm_chose(monkeypatch):
    made = []

    class Sync:
        def __init__(self, *args, vllm_config, **kwargs):
            made.append(("sync", kwargs))

    class Async(Sync):
        def __init__(self, *args, vllm_config, **kwargs):
            made.append(("async", kwargs))

    monkeypatch.setattr(k_driver, "_classes", lambda: (Sync, Async))
    for flag, expected in ((False, "sync"), (True, "async")):
        config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=flag))
        k_driver.runtime_k_scheduler(vllm_config=config, block_size=16)
        assert made[-1] == (expected, {"block_size": 16})


def test_factory_classes_subclass_vllm_schedulers():
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    sync_cls, async_cls = k_driver._classes()
    assert issubclass(sync_cls, Scheduler) and not issubclass(sync_cls, AsyncScheduler)
    assert issubclass(async_cls, AsyncScheduler)
    # the hook runs before vLLM's own schedule()
    assert sync_cls.schedule is k_driver._RuntimeK.schedule


# ---- config ----


def adaptive(**kwargs) -> SpecConfig:
    return SpecConfig(method="mtp", num_speculative_tokens=kwargs.pop("k", 3), adaptive=True, **kwargs)


def test_adaptive_engine_arguments():
    c = RolloutConfig(model="/ckpt", device="cpu", spec=adaptive())
    c.validate()
    args = c.vllm_cli_args(8000)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 3  # k_max
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, k_driver.BATCH_RANGE_END, 2]]  # k_init
    scheduler = args[args.index("--scheduler-cls") + 1]
    assert scheduler == "areal_npu.speculation.k_driver.runtime_k_scheduler"
    module, _, name = scheduler.rpartition(".")  # vLLM imports it by this dotted name
    assert getattr(importlib.import_module(module), name) is k_driver.runtime_k_scheduler
    plain = RolloutConfig(model="/ckpt", device="cpu", spec=SpecConfig(method="mtp", num_speculative_tokens=3))
    assert "--scheduler-cls" not in plain.vllm_cli_args(8000)


@pytest.mark.parametrize(
    ("spec", "k"),
    [
        (adaptive(k=1), 1),  # k_init defaults to min(2, k_max)
        (adaptive(k=3), 2),
        (adaptive(adapt={"k_init": 3}), 3),
        (SpecConfig(method="mtp", num_speculative_tokens=3), 3),  # a fixed k throughout
        (SpecConfig(), 0),
    ],
)
def test_the_draft_length_an_engine_starts_with(spec, k):
    spec.validate()
    assert spec.k_at_start == k


def test_a_draft_length_without_a_method_is_refused():
    """No method: speculation is off, so a draft length would be accepted and ignored."""
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpecConfig(num_speculative_tokens=3).validate()


def test_adapt_is_resolved_by_validate_into_typed_settings():
    spec = adaptive(adapt={"window": 5, "min_gain": 0.1})
    with pytest.raises(RuntimeError, match="validate"):
        spec.adapt_settings  # noqa: B018 - nothing resolved before validate()
    spec.validate()
    settings = spec.adapt_settings
    assert (settings.window, settings.min_gain, settings.k_max, settings.k_init) == (5, 0.1, 3, 2)
    assert SpecAdaptConfig().k_init == 2 and SpecAdaptConfig(k_max=1).k_init == 1  # the one default


@pytest.mark.parametrize(
    ("spec", "key", "match"),
    [
        (SpecConfig(adaptive=True), "adaptive", "needs spec.method"),
        (SpecConfig(method="ngram", num_speculative_tokens=2, adaptive=True), "adaptive", "MTP drafters only"),
        (adaptive(adapt={"windw": 2}), "adapt.windw", "unknown key"),
        (adaptive(adapt={"k_max": 2}), "adapt.k_max", "num_speculative_tokens"),
        (adaptive(adapt={"k_init": 5}), "adapt.k_init", r"\[1, 3\]"),
        (adaptive(adapt={"window": 0}), "adapt.window", ">= 1|≥ 1"),
        (SpecConfig(method="mtp", num_speculative_tokens=2, adapt={"window": 2}), "adapt", "adaptive is true"),
    ],
)
def test_adaptive_config_errors_name_the_key(spec, key, match):
    with pytest.raises(ConfigError, match=match) as err:
        spec.validate()
    assert err.value.key == key
