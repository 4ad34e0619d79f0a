"""Is a task valid? Before a cluster is spent on a task set, every instance is run three ways in its
environment, graded the same way an episode is (:meth:`RepoEnv.grade`):

- the empty patch (the repository as the task ships it): must score 0, or the task is solved before
  the agent starts;
- the gold patch (SWE-bench's ``patch`` column): must score 1, or no agent can solve it;
- a tampered patch that rewrites the hidden tests' files so every FAIL_TO_PASS test trivially passes
  (and deletes the other test files the test patch touches): must score 0, or an agent can earn its
  reward by editing tests. Only where the task has a test patch to tamper with.

The start latency is what ``reset()`` waited for its environment; grading times are per grading.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from areal_npu.agent.env_backends import EnvBackend
from areal_npu.agent.environments import EnvLimits, RepoEnv
from areal_npu.agent.repo_task import CommandTests, RepoTask
from areal_npu.agent.warm_pool import WarmPool

_PATCHED_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.M)


@dataclass
class TaskCheck:
    task_id: str
    start_s: float = 0.0
    empty: float | None = None  # reward of the empty patch
    gold: float | None = None
    tamper: float | None = None  # None: no test patch to tamper with
    grade_s: list[float] = field(default_factory=list)
    error: str = ""
    reasons: dict[str, str] = field(default_factory=dict)  # each patch's grading reason

    @property
    def valid(self) -> bool:
        return not self.error and self.empty == 0.0 and self.gold == 1.0 and self.tamper in (None, 0.0)


def apply_patch(repo: Path, patch: str) -> None:
    """``git apply`` ``patch`` in ``repo`` (a plain directory; git only as the patch tool)."""
    if not patch.strip():
        return
    res = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], input=patch, cwd=repo, text=True,
                         capture_output=True)  # fmt: skip
    if res.returncode != 0:
        raise ValueError(f"the patch does not apply: {res.stderr.strip()[:500]}")


def forged_tests(task: RepoTask) -> dict[str, str]:
    """Test files that make every FAIL_TO_PASS test (pytest ids ``path::[Class::]name``) pass trivially:
    path -> text, for the files the test patch touches (those without a named test become empty)."""
    tests = task.hidden_tests
    if not isinstance(tests, CommandTests) or not tests.patch:
        return {}
    by_file: dict[str, list[list[str]]] = defaultdict(list)
    for test_id in tests.fail_to_pass:
        path, _, rest = test_id.partition("::")
        if rest:
            by_file[path].append(re.sub(r"\[.*$", "", rest).split("::"))
    files = {}
    for path in sorted(set(_PATCHED_FILE.findall(tests.patch)) | set(by_file)):
        lines = []
        for parts in by_file.get(path, ()):
            if len(parts) == 1:
                lines.append(f"def {parts[0]}():\n    pass\n")
            else:
                lines.append(f"class {parts[0]}:\n    def {parts[-1]}(self):\n        pass\n")
        files[path] = "\n".join(lines)
    return files


def _write(repo: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.write_text(text)


def check_task(task: RepoTask, backend: EnvBackend, limits: EnvLimits | None = None,
               pool: WarmPool | None = None) -> TaskCheck:  # fmt: skip
    """Run the three patches of ``task`` and grade each; never raises (errors are in ``error``)."""
    check = TaskCheck(task.task_id)
    gold = str(task.meta.get("patch") or "")
    plans = [("empty", None), ("gold", gold)]
    forged = forged_tests(task)
    if forged:
        plans.append(("tamper", forged))
    for name, change in plans:
        env = RepoEnv(task, limits, backend, pool)
        try:
            env.reset()
            if name == "empty":
                check.start_s = env.start_seconds
            if isinstance(change, dict):
                _write(env.repo, change)
            elif change is not None:
                if not change.strip():
                    check.error = "the task has no gold patch (column `patch`)"
                    break
                apply_patch(env.repo, change)
            result = env.grade()
        except Exception as exc:  # noqa: BLE001 - one broken instance is a row of the table, not a crash
            check.error = f"{name}: {type(exc).__name__}: {exc}"
            break
        finally:
            env.close()
        setattr(check, name, result.reward)
        check.reasons[name] = str(result.details.get("reason", ""))
        if "grade_seconds" in result.details:
            check.grade_s.append(float(result.details["grade_seconds"]))
        if result.details.get("reason") == "sandbox_error":
            check.error = f"{name}: {result.details.get('error', 'sandbox error')}"
            break
    return check
