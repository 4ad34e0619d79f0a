"""The 64K launch scripts (recipes/code_agent_64k/) with LAUNCHER=ray, the default, and no Ray: they stop
with exit code 2 naming the missing `ray` and the extra that provides it, before starting anything;
with a `ray` command (a recording stand-in) a worker node runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "code_agent_64k"
BIN = Path(sys.executable).parent


def _run(tmp_path: Path, chip: str, **extra: str) -> subprocess.CompletedProcess:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text((RECIPES / "qwen3_6_27b_config.json").read_text())
    (tmp_path / "tasks.jsonl").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LAUNCHER", "RAY", "TRAIN_NODES", "RUN_DIR")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHON=sys.executable, NNODES="4" if chip == "a2" else "2",
        MODEL_PATH=str(model), TASKS=str(tmp_path / "tasks.jsonl"), MASTER_ADDR="10.0.0.1", **extra,
    )  # fmt: skip
    script = RECIPES / f"qwen3_6_27b_{chip}.sh"
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )


def test_no_ray_is_a_clear_error_on_every_node(tmp_path):
    for chip, rank in (("a3", "0"), ("a3", "1"), ("a2", "3")):
        out = _run(tmp_path, chip, NODE_RANK=rank, RAY=str(tmp_path / "no-such-ray"))
        assert out.returncode == 2, (chip, rank, out.stdout, out.stderr)
        assert "LAUNCHER=ray" in out.stderr and "is not a command" in out.stderr, out.stderr
        assert 'pip install -e ".[ray]"' in out.stderr and "build_images.sh" in out.stderr
        assert out.stdout == "" and not (tmp_path / "runs").exists()


def test_a_ray_command_named_by_RAY_is_the_one_run(tmp_path):
    fake = tmp_path / "my-ray"
    fake.write_text('#!/bin/sh\necho "my-ray $*"\n')
    fake.chmod(0o755)
    out = _run(tmp_path, "a3", NODE_RANK="1", RAY=str(fake), RAY_PORT="6390")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "my-ray start --address=10.0.0.1:6390 --block"
