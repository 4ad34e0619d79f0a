"""The how-tos in docs/howto/ that build their own inputs run as written: each page's fenced bash
blocks in order, in one bash, in an empty directory (`recipes/` linked in, .venv's commands first on
PATH), after writing the page's `Save as` Python files. What they must produce is checked against
what the page says: the model directory and options reach the recipe, the example task set validates
(gold 1, empty and tampered 0), the custom workflow's reward is the task's minus 0.01 per token."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal_npu.agent.jail import backend

ROOT = Path(__file__).resolve().parents[1]
HOWTO = ROOT / "docs" / "howto"
JAIL_OK, JAIL_WHY = backend("bwrap").available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"the how-tos grade in the bwrap jail: {JAIL_WHY}")


def run_page(name: str, cwd: Path) -> str:
    text = (HOWTO / name).read_text()
    for file, code in re.findall(r"Save as `([\w./]+\.py)`[^`]*?```python\n(.*?)```", text, re.S):
        (cwd / file).write_text(code)
    script = "set -euo pipefail\n" + "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    (cwd / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("TASKS", None)
    done = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{name}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_own_model_with_a_new_head_and_without_speculation(tmp_path):
    from areal_npu.model.tiny import TinyModelConfig, save_tiny_model

    # the reader's checkpoint: a text-only Qwen3.5 without mtp.* weights
    cfg = TinyModelConfig(layout="text", mtp_num_hidden_layers=0, num_hidden_layers=2, linear_attention_every=0,
                          linear_head_dim=0)  # fmt: skip
    save_tiny_model(tmp_path / "my-model", cfg)
    assert not any("mtp" in p.name for p in (tmp_path / "my-model").iterdir())
    out = run_page("own_model.md", tmp_path)
    assert out.count(f"path: {tmp_path / 'my-model'}") == 2, out[-2000:]
    assert "init_new_head: true" in out and re.search(r"method: null", out)


def test_own_tasks_validate_in_both_formats_and_check_in_the_recipe(tmp_path):
    out = run_page("own_tasks.md", tmp_path)
    assert re.search(r"valid 2/2 \| gold pass 100% \| empty pass 0% \| tamper pass 0%", out), out[-3000:]
    assert re.search(r"valid 1/1 \| gold pass 100% \| empty pass 0% \| tamper pass 0%", out), out[-3000:]
    assert (tmp_path / "my_task_repo/tasks/demo__add-1/task.yaml").is_file()
    assert f"dataset: {tmp_path / 'my_tasks/tasks.jsonl'}" in out and "harness: mini_swe_agent" in out


def test_custom_workflow_checks_and_rewards_as_the_page_says(tmp_path, monkeypatch):
    out = run_page("custom_workflow.md", tmp_path)
    assert "path: my_workflow.ShortAnswers" in out
    spec = importlib.util.spec_from_file_location("my_workflow", tmp_path / "my_workflow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    async def graded(self, tasks, samples):  # SingleTurn's grading, stood in for: 1 for the even samples
        return [(1.0 - i % 2, f"r{i}") for i in range(len(samples))]

    monkeypatch.setattr(module.SingleTurn, "grade", graded)
    samples = [SimpleNamespace(output_ids=list(range(n))) for n in (3, 10, 0)]
    workflow = module.ShortAnswers.__new__(module.ShortAnswers)
    got = asyncio.run(workflow.grade([None] * 3, samples))
    assert got == [(1.0 - 0.03, "r0"), (0.0 - 0.10, "r1"), (1.0, "r2")]
