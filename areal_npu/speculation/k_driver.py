"""Change the draft length of a running vLLM engine, without a restart (the engine side of
adaptive speculation; :mod:`areal_npu.speculation.adaptive` is the trainer side that decides k).

vLLM 0.32 can choose the number of speculative tokens per scheduler step ("dynamic speculative
decoding": ``speculative_config.num_speculative_tokens_per_batch_size``, a table batch size -> K
that the scheduler looks up each step and the model runner hands to the drafter; K = 0 drafts
nothing and verifies nothing -- vLLM still runs the drafter to fill its KV cache, which
``areal_npu.compat.vllm.spec_off`` skips). The table is fixed at start-up; adaptive speculation
needs it settable while the engine runs. The scheduler lives in vLLM's engine-core process, which
our HTTP routes cannot reach, so:

* the engine is started with ``num_speculative_tokens = k_max`` and a one-row table (so vLLM knows
  K varies: it plans graphs and padding for that), and with ``--scheduler-cls`` pointing at
  :func:`runtime_k_scheduler`, a subclass of vLLM's own scheduler (sync or async, whichever vLLM
  picked) that reads a one-line control file before each step (~10 us; not by modification time,
  whose resolution is a clock tick);
* the engine process creates the file before vLLM starts (:func:`control_file`), and its
  ``POST /areal/spec_k`` (``rollout/spec_routes.py``) writes it atomically (``write_k``).

Changing K changes only speed: every K verifies with the same rejection sampler, so the sampled
distribution is the target's at any K (tests: greedy outputs equal transformers' at every K and
across switches mid-generation; sampled tokens pass a chi-square test against the exact law).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV_FILE = "AREAL_SPEC_K_FILE"
BATCH_RANGE_END = 1 << 20  # "every batch size": vLLM clips the table at max_num_seqs


def dynamic_table(k: int) -> list[list[int]]:
    """``num_speculative_tokens_per_batch_size`` that runs ``k`` drafts at every batch size."""
    return [[1, BATCH_RANGE_END, int(k)]]


def write_k(path: str | Path, k: int) -> None:
    """Atomically publish a new draft length (tmp file + rename: a reader never sees half a line)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{int(k)}\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def control_file(k: int, keep_drafter_kv: bool) -> Iterator[Path]:
    """The engine process's control file, holding ``k`` (the draft length it starts with), for as
    long as the engine serves; removed afterwards.

    Published through :data:`ENV_FILE` in this process's environment, which vLLM's engine-core
    process (the scheduler) inherits -- so enter it before vLLM starts. Unless ``keep_drafter_kv``,
    the workers also skip the drafter's work at k = 0 (``areal_npu.compat.vllm.spec_off``)."""
    control = Path(tempfile.mkdtemp(prefix="areal-spec-k-")) / "k"
    try:
        write_k(control, k)
        os.environ[ENV_FILE] = str(control)
        if not keep_drafter_kv:
            from areal_npu.compat.vllm import spec_off

            os.environ[spec_off.SKIP_ENV] = "1"  # read in the worker (rollout/worker_ext.py)
        yield control
    finally:
        shutil.rmtree(control.parent, ignore_errors=True)


def read_k(path: str | Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


class _RuntimeK:
    """Mixin for vLLM's Scheduler: before each step, apply the control file's K if it changed."""

    def _areal_init_runtime_k(self) -> None:
        self._areal_k_file = os.environ.get(ENV_FILE)
        self._areal_k_read: int | None = None
        self.areal_spec_k = self.num_spec_tokens
        self.areal_last_k: int | None = None

    def _areal_poll_k(self) -> None:
        if not self._areal_k_file:
            return
        k = read_k(self._areal_k_file)
        if k is None or k == self._areal_k_read:
            return
        self._areal_k_read = k
        k = max(0, min(k, self.num_spec_tokens))
        # index = number of requests scheduled this step (index 0 unused by vLLM)
        self.dynamic_sd_lookup = [k] * (self.scheduler_config.max_num_seqs + 1)
        self.areal_spec_k = k

    def schedule(self, *args, **kwargs):
        self._areal_poll_k()
        output = super().schedule(*args, **kwargs)
        # the K the step about to run drafts with (read by compat.vllm.spec_off's post_step)
        self.areal_last_k = output.num_spec_tokens_to_schedule
        return output


def _classes():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    class RuntimeKScheduler(_RuntimeK, Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._areal_init_runtime_k()

    class RuntimeKAsyncScheduler(_RuntimeK, AsyncScheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._areal_init_runtime_k()

    return RuntimeKScheduler, RuntimeKAsyncScheduler


def runtime_k_scheduler(*args, vllm_config, **kwargs):
    """What ``--scheduler-cls`` names: vLLM instantiates ``Scheduler(vllm_config=..., ...)``.

    A factory rather than a class because vLLM decides sync vs async scheduling after parsing the
    arguments (the CPU backend forces sync); the subclass must extend the one vLLM would have used.
    """
    from areal_npu.compat.vllm import spec_off

    spec_off.apply_engine_core()  # this runs in vLLM's engine-core process
    sync_cls, async_cls = _classes()
    cls = async_cls if vllm_config.scheduler_config.async_scheduling else sync_cls
    return cls(*args, vllm_config=vllm_config, **kwargs)
