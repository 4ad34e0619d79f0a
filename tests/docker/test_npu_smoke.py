"""scripts/npu_smoke.py: --help, a clear exit on a machine without an NPU, and its own CPU check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "npu_smoke.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "AREAL_NPU_DEVICE"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


def test_help():
    out = run("--help")
    assert out.returncode == 0
    assert "--skip-vllm" in out.stdout and "Exit status" in out.stdout


def test_without_an_npu_it_says_so_and_passes_nothing():
    out = run()
    assert out.returncode == 3, out.stdout + out.stderr
    assert "no usable Ascend NPU" in out.stderr and "nothing was tested" in out.stderr
    assert "PASS" not in out.stdout


def test_the_attention_check_itself_on_the_cpu_path():
    out = run("--device", "cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  packed attention" in out.stdout
    assert "vLLM check runs on an NPU only" in out.stderr
