"""`areal-npu train recipes/cpu/swe_agent.yaml`, shortened: the code agent on real SWE tasks (bugs planted
in toolz 1.0.0 from its PyPI sdist, caught by its own tests) in their Debian image through bubblewrap,
driven by mini-swe-agent v2 through the gateway, graded the SWE-bench way, for one step. CI's set is the spec's first library, 3 tasks
(scripts/make_swe_tasks.py --library toolz --max-per-lib 3: pip download + the suites in the jail).

References: the set's own rows (their number, each validated at build time: gold -> 1, empty -> 0), the
recipe's budgets, the episode-ending reasons adding up to one, the backend named in the recipe recorded
for every episode, an untouched repository scoring 0 (an untrained model's episodes are format errors:
nothing it did can pass toolz's failing tests), and no process outliving the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from areal_npu import names
from areal_npu.agent import harness
from areal_npu.agent.jail import backend

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu" / "swe_agent.yaml"
JAIL_OK, JAIL_WHY = backend("bwrap").available()
GROUP = 2


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
def test_swe_agent_recipe_runs_on_real_tasks(tmp_path):
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_swe_tasks.py"), "--library", "toolz",
                           "--max-per-lib", "3", "--quiet", "--json", str(tmp_path / "set.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    built = json.loads((tmp_path / "set.json").read_text())
    tasks = Path(built["path"]) / "tasks.jsonl"
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    assert len(rows) == 3 and all(r["library"] == "toolz==1.0.0" for r in rows)

    run_dir = tmp_path / "run"
    env = {**os.environ, "TASKS": str(tasks), "IMAGES": built["image_root"]}
    # the warm start shortened to its path (2 demonstrations recorded through mini-swe-agent, 2 SFT steps)
    args = [f"run_dir={run_dir}", "task.n_train=2", "task.n_eval=1", "controller.steps=1",
            f"workflow.group_size={GROUP}", "workflow.max_turns=2", "controller.batch_groups=1",
            "warmstart.steps=2", "warmstart.demo_tasks=2"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "areal_npu.cli", "train", str(RECIPE), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    leftover = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert not leftover, "engine processes outlived the run"
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ep = {k[len("episode/") :]: v for k, v in row.items() if k.startswith("episode/")}
    assert row[names.env_backend_key("bwrap")] == GROUP and row[names.FAILED_GROUPS] == 0
    assert 1 <= ep["turns"] <= 2 and sum(ep[r] for r in harness.END_REASONS) == pytest.approx(1)
    assert ep["env_error"] == 0, "mini-swe-agent ended an episode with an error of its own"
    # mini-swe-agent drops a reply it cannot parse: each later call starts a segment, trained as its own
    assert ep["history_rewrites"] <= ep["format_errors"]
    assert (run_dir / "warmstart").is_dir()
    # token exactness: the trainer's log-probs of the recorded tokens (same weights, version 0, float32)
    # match the engine's behaviour log-probs (bf16) on every trained token, every segment included
    ratio = names.BEHAVE_IMP_WEIGHT
    assert 0.9 < row[ratio + "/min"] <= row[ratio + "/max"] < 1.1, {k: v for k, v in row.items() if ratio in k}
    # every toolz task lists its failing and passing tests; grading read them all from toolz's own log
    assert ep["tests_total"] > 10 and ep["tests_passed"] < ep["tests_total"]
    if ep["format_errors"] == ep["turns"]:  # nothing ran: the repository is the task's, unsolved
        assert ep["reward"] == 0.0 and row[names.reward_reason_key("unresolved")] == GROUP
    assert ep["env_start_s"] > 0 and ep["grade_s"] > 0 and ep["per_minute"] > 0
    assert ep["grade_s_p95"] >= ep["grade_s"] - 1e-9  # of two values, the 95th percentile is >= their mean
