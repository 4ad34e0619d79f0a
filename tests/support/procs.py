"""Race-free questions about other processes: any of them may exit between being listed and being asked."""

from __future__ import annotations

import signal

import psutil

GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def alive(procs) -> list[psutil.Process]:
    """The processes of ``procs`` that still run (not exited, not a zombie waiting for its parent)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() not in GONE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def alive_pids(pids) -> list[int]:
    return [p.pid for p in alive(_existing(pids))]


def _existing(pids):
    for pid in pids:
        try:
            yield psutil.Process(pid)
        except psutil.NoSuchProcess:
            pass


def sigint_default() -> None:
    """``preexec_fn`` for a child that must take Ctrl-C as a terminal's job does: a shell starts
    background jobs (pytest under ``cmd &``, say) with SIGINT ignored, and children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
