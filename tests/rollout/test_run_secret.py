"""A short ``areal-npu train`` with ``rollout.weight_transport=gloo``: the loop pushes its weights
through the broadcast transport it names (the engine counts the updates committed by broadcast), and
the run's engine secret -- which reached the engines, or nothing would have run -- is in no
process's command line, in no file under the run directory (``config.yaml``, metrics, engine logs,
checkpoints) and not in the trainer's output.

The run is then stopped with Ctrl-C (SIGINT) after three logged steps, as a user stops it: it exits
non-zero, no engine process outlives it, and the steps it logged are kept, each once, in order."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_LAYOUT = [
    "model.tiny.layout=text", "model.tiny.num_hidden_layers=2", "model.tiny.linear_attention_every=0",
    "model.tiny.linear_head_dim=0", "rollout.dtype=float32",
]  # fmt: skip


def _servers(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if "areal_npu.rollout.server" in cmdline and str(run_dir) in cmdline:
            found.append(proc)
    return found


@pytest.mark.slow
@pytest.mark.vllm
def test_the_secret_is_nowhere_readable_and_ctrl_c_stops_everything_keeping_the_log(tmp_path):
    from tests.support.procs import sigint_default

    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    overrides = [f"run_dir={run_dir}", "warmstart.steps=2", "controller.steps=50", "controller.eval_every=0",
                 "controller.checkpoint_every=1", "controller.batch_groups=2", "rollout.weight_transport=gloo",
                 *TEXT_LAYOUT]  # fmt: skip
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_npu.cli", "train", str(ROOT / "recipes/cpu/quickstart.yaml"), *overrides],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
            preexec_fn=sigint_default,  # as a terminal's job gets it, however pytest was started
        )  # fmt: skip
        secret, cmdlines, committed = None, [], {}
        deadline = time.monotonic() + 900
        while proc.poll() is None:
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            if metrics.exists() and metrics.read_text().count("\n") >= 3:
                proc.send_signal(signal.SIGINT)  # Ctrl-C
                proc.wait(120)
                break
            for server in _servers(run_dir):
                try:
                    environ = server.environ()  # the same user may read it; others may not
                    group = [p for p in psutil.process_iter() if _pgid(p.pid) == _pgid(server.pid)]
                    cmdlines += [open(f"/proc/{p.pid}/cmdline", "rb").read() for p in group]
                except (psutil.Error, OSError):
                    continue
                secret = secret or environ.get("AREAL_ENGINE_SECRET")
                committed = _committed(server, secret) or committed
            time.sleep(0.5)
    assert proc.returncode not in (0, None), log_path.read_text()[-4000:]  # interrupted, not finished
    deadline = time.monotonic() + 30
    while _servers(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _servers(run_dir), "engine processes survived Ctrl-C"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 3
    assert secret and len(secret) >= 40, "no engine server seen with its secret"
    # every step's weights went by the broadcast (3 steps; the last read may miss the last one)
    assert committed.get("broadcast", 0) >= 2 and committed.get("rpc") == 0, committed
    assert len(cmdlines) >= 2
    assert all(secret.encode() not in c for c in cmdlines)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any("checkpoints" in p.parts for p in files)
    assert any(p.suffix == ".log" for p in files)  # the engines' logs are under the run directory
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
    assert secret not in log_path.read_text()


def _committed(server: psutil.Process, secret: str | None) -> dict:
    """The engine's committed-update counters (``/areal/version``), read with the run's secret."""
    import httpx

    if not secret:
        return {}
    cmdline = server.cmdline()
    port = cmdline[cmdline.index("--port") + 1]
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/areal/version",
                             headers={"Authorization": f"Bearer {secret}"}, timeout=5)  # fmt: skip
    except httpx.HTTPError:
        return {}
    return response.json().get("committed", {}) if response.status_code == 200 else {}


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
