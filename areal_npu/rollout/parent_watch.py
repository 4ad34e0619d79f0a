"""The engine process's tie to its launcher, kept apart from ``server`` so that it imports only
the standard library (its test runs on machines without vLLM or FastAPI)."""

import os
import signal
import threading
import time


def die_with_parent(poll_s: float = 1.0) -> None:
    """End this engine's whole process group when the process that launched it dies.

    The launcher starts each engine in a session of its own (so a signal to the trainer's group
    does not hit vLLM mid-update); without this a SIGKILLed trainer would leave the engine and
    vLLM's workers running. A watchdog thread polls ``getppid`` (re-parenting means the launcher
    is gone). Not PR_SET_PDEATHSIG: it fires when the launching *thread* exits, and engines are
    restarted from worker threads.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
    if os.getppid() != parent:  # the parent died before we got here
        os.killpg(os.getpgid(0), signal.SIGKILL)
