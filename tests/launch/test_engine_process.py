"""Engine process lifecycle with stand-in servers (no vLLM): health wait, start-up timeout with the
log tail, restart, and no orphans after stop, Ctrl-C or SIGTERM -- grandchildren included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_npu.launch.engine_process import EngineProcess, EngineStartError
from areal_npu.rollout.config import RolloutConfig

# (the drivers below import this file by path, without the ``tests`` package: no import from it here)


def sigint_default() -> None:
    """``preexec_fn``: take SIGINT as a terminal's job does (a shell's background job, e.g. pytest
    under ``cmd &``, starts with it ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# a stand-in engine: spawns a grandchild (like vLLM's engine core), prints, then serves or not
FAKE = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, time
    mode, port = sys.argv[1], int(sys.argv[2])
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("booting fake engine", flush=True)
    if mode == "exit":
        print("Traceback: boom", flush=True); sys.exit(3)
    if mode == "hang":
        time.sleep(600)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


class FakeEngine(EngineProcess):
    mode = "serve"

    def command(self):
        return [sys.executable, "-c", FAKE, self.mode, str(self.port)]


def fake(tmp_path, mode, timeout=20.0):
    engine = FakeEngine(
        RolloutConfig(model="m", device="cpu", startup_timeout_s=timeout, log_dir=str(tmp_path))
    )
    engine.mode = mode
    return engine


def group_gone(pgid, wait=5.0):
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_start_health_stop_leaves_no_process(tmp_path):
    engine = fake(tmp_path, "serve").start()
    pgid = engine.pgid
    assert engine.healthy() and engine.group_alive()
    engine.stop()
    assert group_gone(pgid) and not engine.alive()


def test_startup_timeout_raises_with_log_tail_and_cleans_up(tmp_path):
    engine = fake(tmp_path, "hang", timeout=3.0)
    start = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        engine.start()
    assert time.monotonic() - start < 20
    assert "not healthy after 3 s" in str(err.value) and "booting fake engine" in str(err.value)
    assert engine.pgid is None
    assert not engine.alive()


def test_engine_exiting_during_startup_reports_code_and_log(tmp_path):
    with pytest.raises(EngineStartError) as err:
        fake(tmp_path, "exit").start()
    assert "exited with code 3" in str(err.value) and "Traceback: boom" in str(err.value)


def test_restart_replaces_the_whole_group(tmp_path):
    engine = fake(tmp_path, "serve").start()
    old = engine.pgid
    os.kill(engine.proc.pid, signal.SIGKILL)  # the leader dies; its grandchild would linger
    assert not engine.healthy()
    engine.restart()
    try:
        assert engine.healthy() and engine.pgid != old and engine.restarts == 1
        assert group_gone(old)
    finally:
        engine.stop()


DRIVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_engine_process import fake
    import pathlib
    e = fake(pathlib.Path({tmp!r}), "serve").start()
    print(e.pgid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_no_orphans_when_the_parent_is_interrupted(tmp_path, sig):
    code = DRIVER.format(tests=os.path.dirname(__file__), tmp=str(tmp_path))
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              preexec_fn=sigint_default)  # fmt: skip
    try:
        pgid = int(driver.stdout.readline())
        os.killpg(pgid, 0)  # engine group up
        driver.send_signal(sig)  # Ctrl-C / kill of the trainer
        driver.wait(timeout=30)
        assert group_gone(pgid, wait=10)
    finally:
        driver.kill()


def test_a_signal_the_trainer_ignores_stays_ignored():
    """Started with SIGINT ignored (a shell's background job, nohup), the trainer keeps ignoring it:
    a handler that killed the engines on it would only make the loop restart them and go on."""
    code = textwrap.dedent(
        """
        import signal
        from areal_npu.launch import engine_process
        engine_process.install_stop_handlers()
        print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM) != signal.SIG_DFL)
        """
    )
    ignoring = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    assert ignoring.stdout.split() == ["True", "True"]  # SIGINT left ignored, SIGTERM still hooked
    taking = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            preexec_fn=sigint_default)  # fmt: skip
    assert taking.stdout.split() == ["False", "True"]  # a terminal's job: both hooked


def _group_pids(pgid):
    import psutil

    return [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid]


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_the_runs_secret_reaches_the_engine_by_environment_only(tmp_path):
    """In the leader's environment (readable by its user only), in no process's command line (which
    every user can read), nor in the engine's log; a restart keeps the same secret."""
    engine = fake(tmp_path, "serve")
    engine.secret = "not-on-the-command-line-" + "x" * 20
    engine.start()
    try:
        pids = _group_pids(engine.pgid)
        assert len(pids) >= 2  # the leader and its grandchild
        for pid in pids:
            assert engine.secret.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
        environ = open(f"/proc/{engine.proc.pid}/environ", "rb").read().split(b"\0")
        assert f"AREAL_ENGINE_SECRET={engine.secret}".encode() in environ
        engine.restart()
        environ = open(f"/proc/{engine.proc.pid}/environ", "rb").read().split(b"\0")
        assert f"AREAL_ENGINE_SECRET={engine.secret}".encode() in environ
    finally:
        engine.stop()
    assert engine.secret not in engine.log_path.read_text()
    assert engine.secret not in engine.cfg.to_json() and engine.secret not in str(engine.info())


def test_one_secret_per_run_and_each_engine_on_its_planned_host(monkeypatch):
    from areal_npu.launch.engines import launch_engines

    started = []
    monkeypatch.setattr(EngineProcess, "start", lambda self: started.append(self) or self)
    cfg = RolloutConfig(model="m", device="cpu", num_engines=2)
    first = launch_engines(cfg, hosts=["127.0.0.1", "127.0.0.2"])
    second = launch_engines(cfg)
    assert first[0].secret == first[1].secret and len(first[0].secret) >= 40
    assert second[0].secret != first[0].secret  # a new run, a new secret
    assert [e.cfg.host for e in first] == ["127.0.0.1", "127.0.0.2"] and first[1].url.startswith("http://127.0.0.2:")
    assert EngineProcess(cfg).secret != EngineProcess(cfg).secret
