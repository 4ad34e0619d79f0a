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

With ``spec.adapt.by_context`` the file holds one K per context bucket after the default K
(``write_k(path, k, by_context)``); before each step the scheduler takes the K of the bucket that
holds most of its running requests' contexts, the waiting ones' when none runs (:func:`batch_k`: vLLM
drafts one K per step for the whole batch, no per-request K).

Changing K changes only speed: every K verifies with the same rejection sampler, so the sampled
distribution is the target's at any K (tests: greedy outputs equal transformers' at every K and
across switches mid-generation; sampled tokens pass a chi-square test against the exact law).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from areal_npu.speculation.context import context_bucket

ENV_FILE = "AREAL_SPEC_K_FILE"
BATCH_RANGE_END = 1 << 20  # "every batch size": vLLM clips the table at max_num_seqs


def dynamic_table(k: int) -> list[list[int]]:
    """``num_speculative_tokens_per_batch_size`` that runs ``k`` drafts at every batch size."""
    return [[1, BATCH_RANGE_END, int(k)]]


def write_k(path: str | Path, k: int, by_context: Sequence[int] | None = None) -> None:
    """Atomically publish a new draft length (tmp file + rename: a reader never sees half a line);
    with ``by_context``, one k per context bucket (``k`` then serves a batch with nothing running)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(" ".join(str(int(v)) for v in (k, *(by_context or ()))) + "\n")
    os.replace(tmp, path)


def batch_k(contexts: Sequence[int], table: Sequence[int], default: int) -> int:
    """The k of one scheduler step from the per-bucket ``table``: the k of the bucket holding most of the
    running requests' contexts (tied buckets: the smallest k); ``default`` with nothing running."""
    if not contexts:
        return default
    counts = Counter(context_bucket(c) for c in contexts)
    top = max(counts.values())
    return min(table[min(b, len(table) - 1)] for b, n in counts.items() if n == top)


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


def read_line(path: str | Path) -> tuple[int, list[int]] | None:
    """``(k, per-bucket table)`` (an empty table: one k for every batch), or None when unreadable."""
    try:
        parts = Path(path).read_text().split()
    except OSError:
        return None
    if not parts or not all(p.lstrip("-").isdigit() for p in parts):
        return None
    return int(parts[0]), [int(p) for p in parts[1:]]


def read_k(path: str | Path) -> int | None:
    line = read_line(path)
    return None if line is None else line[0]


class _RuntimeK:
    """Mixin for vLLM's Scheduler: before each step, apply the control file's K if it changed."""

    def _areal_init_runtime_k(self) -> None:
        self._areal_k_file = os.environ.get(ENV_FILE)
        self._areal_k_read: tuple[int, list[int]] | None = None
        self._areal_table: list[int] = []
        self._areal_applied: int | None = None  # the k this mixin last put in vLLM's table
        self.areal_spec_k = self.num_spec_tokens
        self.areal_last_k: int | None = None

    def _areal_set_k(self, k: int) -> None:
        k = max(0, min(k, self.num_spec_tokens))
        if k != self._areal_applied:
            self._areal_applied = k
            # index = number of requests scheduled this step (index 0 unused by vLLM)
            self.dynamic_sd_lookup = [k] * (self.scheduler_config.max_num_seqs + 1)
            self.areal_spec_k = k

    def _areal_poll_k(self) -> None:
        if not self._areal_k_file:
            return
        line = read_line(self._areal_k_file)
        if line is not None and line != self._areal_k_read:
            self._areal_k_read = line
            self._areal_table = line[1]
            if not self._areal_table:
                self._areal_set_k(line[0])
        if self._areal_table and self._areal_k_read is not None:
            # per context bucket: the dominant bucket of the batch vLLM is about to extend (the waiting
            # requests' when none runs yet: the step that prefills them drafts their first k)
            batch = list(getattr(self, "running", ())) or list(getattr(self, "waiting", ()))
            contexts = [r.num_tokens for r in batch]
            self._areal_set_k(batch_k(contexts, self._areal_table, self._areal_k_read[0]))

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
