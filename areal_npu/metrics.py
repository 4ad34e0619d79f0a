"""Per-step metrics of a run: ``metrics.jsonl``, TensorBoard scalars and the console status line.

``<run_dir>/metrics.jsonl`` holds one JSON object per training step: ``{"step": int, "time": unix
seconds, <key>: value, ...}``. Each line is flushed and fsync'ed before :meth:`StatsLogger.log`
returns, so a ``kill -9`` loses at most the line being written; a torn last line is cut off when
the file is opened again. Non-finite floats are written as ``null`` (strict JSON); lists (e.g.
``rollout/spec_accept_per_pos``) and strings are kept in the JSON and skipped by TensorBoard.

Resuming from a checkpoint at step ``s``: call :meth:`StatsLogger.truncate_after(s)` before logging
``s + 1``; it rewrites the file atomically (temp file + rename) without the later steps, and the
TensorBoard writer purges its events from ``s + 1`` on. :meth:`StatsLogger.log` refuses a step that
is not after the last one in the file, so steps are never duplicated.

Reading the file back: :func:`read_metrics`. torch (TensorBoard) and rich are imported lazily.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from areal_npu import names

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"



class MetricsError(ValueError):
    """A metrics file that is missing, empty or unreadable."""


def _clean(key: str, value: Any) -> Any:
    """A JSON-safe value: finite float, int, ``None`` (non-finite), list of those, or a string."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_clean(key, v) for v in value]
    if hasattr(value, "tolist"):  # torch / numpy scalars and arrays
        return _clean(key, value.tolist())
    raise TypeError(f"metric {key!r}: cannot log a {type(value).__name__}")


def _parse_lines(text: str, file: Path) -> list[dict]:
    """Parse JSONL; a torn last line (no newline, not valid JSON) is dropped, anything else raises."""
    rows = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # the line being written when the process died
                continue
            raise MetricsError(f"{file}:{i + 1}: not a JSON object ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise MetricsError(f"{file}:{i + 1}: expected an object with an integer 'step'")
        rows.append(row)
    return rows


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of ``metrics.jsonl`` (``path`` is the run directory or the file), sorted by step.

    A step that occurs more than once (a resume that did not truncate) keeps its last line.
    Raises :class:`MetricsError` when the file is missing, unreadable or holds no steps.
    """
    path = Path(path)
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        raise MetricsError(f"no {METRICS_FILE} at {file}")
    rows = _parse_lines(file.read_text(), file)
    if not rows:
        raise MetricsError(f"{file} holds no steps")
    by_step = {row["step"]: row for row in rows}
    return [by_step[s] for s in sorted(by_step)]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def format_status(step: int, total_steps: int, stats: dict, reward_start: float | None = None) -> str:
    """``step 12/40 | reward 0.41 (+0.22) | accept 0.63 len 2.1 | stale max 1 | imp_w 0.999 | step 8.3s (gen 5.1 prox 0.6 train 2.0 sync 0.4)``.

    Fields whose keys are absent (or not finite) are left out; the phases are those of
    :data:`areal_npu.names.PHASES` the step logged. The reward change is against ``reward_start``
    (the first logged reward of the run), shown when given.
    """

    def num(key: str) -> float | None:
        v = stats.get(key)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            return None
        return float(v)

    parts = [f"step {step}/{total_steps}"]
    reward = num(names.REWARD_MEAN)
    if reward is not None:
        delta = f" ({reward - reward_start:+.2f})" if reward_start is not None else ""
        parts.append(f"reward {reward:.2f}{delta}")
    spec = []
    if (accept := num(names.SPEC_ACCEPT_RATE)) is not None:
        spec.append(f"accept {accept:.2f}")
    if (length := num(names.SPEC_MEAN_ACCEPTED_LEN)) is not None:
        spec.append(f"len {length:.1f}")
    if spec:
        parts.append(" ".join(spec))
    if (stale := num(names.STALENESS_MAX)) is not None:
        parts.append(f"stale max {stale:g}")
    if (imp := num(names.BEHAVE_IMP_WEIGHT_MEAN)) is not None:
        parts.append(f"imp_w {imp:.3f}")
    phases = [f"{p} {v:.1f}" for p in names.PHASES if (v := num(names.timing_key(p))) is not None]
    step_s = num(names.STEP_TIME)
    if step_s is not None or phases:
        timing = f"step {step_s:.1f}s" if step_s is not None else "time"
        parts.append(f"{timing} ({' '.join(phases)})" if phases else timing)
    return " | ".join(parts)


class StatsLogger:
    """Writes one training step's stats to ``metrics.jsonl``, TensorBoard and the console.

    ``console``: show a rich progress bar with the status line printed above it per step when
    ``stream`` is a terminal, else print the plain status line per step (headless runs, CI logs).
    ``tensorboard=False`` skips the TensorBoard writer (and the torch import).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        total_steps: int,
        console: bool = True,
        *,
        tensorboard: bool = True,
        stream: TextIO | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = int(total_steps)
        self.path = self.run_dir / METRICS_FILE
        self._tensorboard = tensorboard
        self._tb = None
        self._purge_step: int | None = None
        self._stream = stream if stream is not None else sys.stdout
        self._console = console
        self._live: bool | None = None  # decided at the first step: a terminal gets a live bar
        self._progress = None
        self._task = None
        self._repair_torn_line()
        self._load_state(_parse_lines(self.path.read_text(), self.path) if self.path.exists() else [])
        if self.last_step is not None:
            # A restart: hide TensorBoard events of steps that are logged again.
            self._purge_step = self.last_step + 1
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()

    # --- file state ---------------------------------------------------------------------------------

    def _repair_torn_line(self) -> None:
        """Cut a last line that lacks its newline (the write a kill interrupted)."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                f.flush()
                os.fsync(f.fileno())

    def _load_state(self, rows: list[dict]) -> None:
        self.last_step: int | None = max((r["step"] for r in rows), default=None)
        rewards = [r for r in sorted(rows, key=lambda r: r["step"]) if r.get(names.REWARD_MEAN) is not None]
        self._reward_start: float | None = float(rewards[0][names.REWARD_MEAN]) if rewards else None

    def truncate_after(self, step: int) -> None:
        """Keep only lines with ``step <= step`` (atomic rewrite); later steps may then be logged again."""
        self._file.close()
        rows = _parse_lines(self.path.read_text(), self.path) if self.path.exists() else []
        kept = [r for r in rows if r["step"] <= step]
        fd, tmp = tempfile.mkstemp(dir=self.run_dir, prefix=f".{METRICS_FILE}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.run_dir)
        self._load_state(kept)
        self._file = open(self.path, "a", encoding="utf-8")
        self._purge_step = step + 1
        if self._tb is not None:  # reopen so the purge applies to events already written
            self._tb.close()
            self._tb = None

    # --- logging ------------------------------------------------------------------------------------

    def log(self, step: int, stats: dict[str, Any]) -> str:
        """Append step ``step``; returns its status line. ``step`` must follow the last logged step."""
        step = int(step)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(
                f"step {step} is not after the last logged step {self.last_step}; "
                f"call truncate_after({step - 1}) when resuming"
            )
        for reserved in ("step", "time"):
            if reserved in stats:
                raise ValueError(f"stats must not contain the reserved key {reserved!r}")
        row = {"step": step, "time": time.time()}
        row.update({k: _clean(k, v) for k, v in stats.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.last_step = step
        if self._reward_start is None and row.get(names.REWARD_MEAN) is not None:
            self._reward_start = float(row[names.REWARD_MEAN])
        self._write_tensorboard(step, row)
        line = format_status(step, self.total_steps, row, self._reward_start)
        if self._console:
            self._show(step, line)
        return line

    def _write_tensorboard(self, step: int, row: dict) -> None:
        if not self._tensorboard:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=self._purge_step)
            self._purge_step = None
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, global_step=step)
        self._tb.flush()

    def print(self, message: str) -> None:
        """A one-off message (a dropped group, a draft-length change): above the progress bar when
        there is one, else a plain line on the status stream."""
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self._stream, flush=True)

    def _show(self, step: int, line: str) -> None:
        if self._live is None:
            from rich.console import Console

            self._live = Console(file=self._stream).is_terminal
        if not self._live:
            print(line, file=self._stream, flush=True)
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self._stream),
            )
            self._task = self._progress.add_task("train", total=self.total_steps)
            self._progress.start()
        self._progress.console.print(line, markup=False, highlight=False)
        self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> StatsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["METRICS_FILE", "MetricsError", "StatsLogger", "format_status", "read_metrics"]
