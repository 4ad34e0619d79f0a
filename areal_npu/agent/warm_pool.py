"""Episode repositories prepared ahead: a warm pool of copies of each task's base tree.

A task's base tree (its snapshot, or the repository its image ships at the work dir) is made once
per task and kept; every episode, and every grading, gets a copy of it. ``prefetch(task, n)``
starts ``n`` copies in the pool's threads while other episodes run (the shell agent calls it when a
task's group starts, so a group's episodes do not queue behind one another's copies); ``take(task)``
hands one over, waiting only for what is not ready yet. With ``area``, each copy is a size-capped
tmpfs of its own (:mod:`areal_npu.agent.fs`) where the trainer may mount one; otherwise copies are
copy-on-write where the filesystem allows it (``cp --reflink=auto``: btrfs, XFS), whole copies else.

``take`` returns the seconds the caller waited: the episode's environment start latency, which the
shell agent reports per episode (``env_start_s``) beside its grading time (``grade_s``).
"""

from __future__ import annotations

import tempfile
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from areal_npu.agent.fs import copy_into_area, copy_tree, remove_tree

__all__ = ["WarmPool", "copy_tree"]


class WarmPool:
    """Copies of tasks' base trees, made ahead. ``make_base(task, dest)`` fills the empty ``dest`` with
    the task's base tree (called once per task id). ``area``: ``(max_bytes, room_bytes, room_files)``,
    each copy made in a size-capped area of its own (:func:`areal_npu.agent.fs.copy_into_area`) where
    this process can mount one; None: plain copies."""

    def __init__(self, make_base: Callable[[object, Path], None], workers: int = 2, keep: int = 8,
                 area: tuple[int, int, int] | None = None):  # fmt: skip
        self.make_base, self.area = make_base, area
        self.root = Path(tempfile.mkdtemp(prefix="areal-envs-"))
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="warm-pool")
        self.lock = threading.Lock()
        self.bases: dict[str, Future] = {}
        self.ready: dict[str, deque[Future]] = defaultdict(deque)
        self.keep = keep  # task bases kept; the oldest is dropped past it (with its unused copies)
        self.count = 0
        self.closed = False
        # copies and bases are removed at close(), or when the pool is collected or the process exits
        self._cleanup = weakref.finalize(self, remove_tree, self.root)

    def _base(self, task) -> Path:
        # Made inline by the first caller, never queued on the pool: a copy job waiting in a pool thread
        # for a base queued behind it on the same saturated pool would wait forever.
        with self.lock:
            fut = self.bases.get(task.task_id)
            mine = fut is None
            if mine:
                dest = self.root / f"base-{len(self.bases)}-{abs(hash(task.task_id)) % 10**8}"
                fut = self.bases[task.task_id] = Future()
                self._evict()
        if mine:
            try:
                dest.mkdir(parents=True)
                self.make_base(task, dest)
                fut.set_result(dest)
            except BaseException as exc:
                fut.set_exception(exc)
        return fut.result()

    def _evict(self) -> None:  # under the lock
        while len(self.bases) > self.keep:
            task_id = next(iter(self.bases))
            self.bases.pop(task_id).add_done_callback(lambda f: f.exception() or remove_tree(f.result()))
            for fut in self.ready.pop(task_id, ()):
                fut.add_done_callback(lambda f: f.exception() or remove_tree(f.result()))

    def base(self, task) -> Path:
        """The task's base tree (read it, never write it)."""
        return self._base(task)

    def _copy(self, task) -> Path:
        base = self._base(task)
        with self.lock:
            self.count += 1
            holder = self.root / f"episode-{self.count}"
        holder.mkdir()
        if self.area is not None:
            copy_into_area(base, holder / "repo", *self.area)
        else:
            copy_tree(base, holder / "repo")
        return holder / "repo"

    def prefetch(self, task, n: int) -> None:
        """Start ``n`` more copies of ``task``'s base tree in the background."""
        with self.lock:
            if self.closed:
                return
            for _ in range(n):
                self.ready[task.task_id].append(self.pool.submit(self._copy, task))

    def take(self, task) -> tuple[Path, float]:
        """A fresh copy of the task's base tree and the seconds waited. The copy is ``repo`` in a directory
        of its own (its area's mount point is below it): the caller owns that directory and removes it."""
        start = time.monotonic()
        with self.lock:
            queue = self.ready.get(task.task_id)
            fut = queue.popleft() if queue else None
        path = fut.result() if fut is not None else self._copy(task)
        return path, time.monotonic() - start

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)
        self._cleanup()
