"""An engine process never outlives the trainer that launched it, even after SIGKILL.

The watchdog lives in ``parent_watch`` (standard library only), so this test needs no vLLM; the
engine process ``server.main`` starts it first thing (checked below without starting vLLM)."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.support.procs import alive

GRANDCHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    # the watchdog must not need the server's dependencies: the test runs where they are missing
    sys.modules.update(fastapi=None, vllm=None, uvloop=None)
    from areal_npu.rollout.parent_watch import die_with_parent
    die_with_parent(poll_s=0.1)
    # a worker of the engine, in the engine's process group (like vLLM's engine core)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("ready", flush=True)
    time.sleep(600)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    # like the launcher: the engine gets a session (process group) of its own
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    print(p.pid, flush=True)
    time.sleep(600)
    """
)


def test_engine_group_dies_when_launcher_is_killed():
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, GRANDCHILD], stdout=subprocess.PIPE, text=True
    )
    engine_pid = int(launcher.stdout.readline())
    engine = psutil.Process(engine_pid)
    group = [engine] + engine.children(recursive=True)
    assert len(group) == 2 and all(p.is_running() for p in group)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(10)
    _, still = psutil.wait_procs(group, timeout=20)
    assert not alive(still)


def test_server_main_starts_the_watchdog_first(monkeypatch):
    """``server.main`` arms the watchdog before it parses anything (a bad config must not leave an
    engine that outlives its launcher)."""
    pytest.importorskip("fastapi")
    from areal_npu.rollout import server

    armed = []
    monkeypatch.setattr(server, "die_with_parent", lambda: armed.append(True))
    with pytest.raises(SystemExit):
        server.main(["--port", "1"])  # --config missing: argparse exits
    assert armed == [True]
