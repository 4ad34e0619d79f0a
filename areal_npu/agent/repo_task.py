"""What a repository task is: its snapshot or image, its problem statement, its hidden tests, and
what grading says about an episode. Plain data, read by the loaders, the environments and grading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_IN_JAIL = "/repo"  # where an embedded task's repository is (no image: the host's interpreter)
TESTBED = "/testbed"  # where SWE-bench and R2E-Gym images keep the repository


@dataclass(frozen=True)
class CallTest:
    module: str
    function: str
    args: Any  # list of positional arguments (plain JSON)
    expected: Any


@dataclass(frozen=True)
class CommandTests:
    command: str  # run in the grading copy's root
    files: Mapping[str, str] = field(default_factory=dict)  # hidden test files: repo path -> text
    patch: str = ""  # a unified diff adding the hidden tests (SWE-bench test_patch)
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    log_parser: str = "pytest"  # the swebench log parser that reads the test log
    # R2E-Gym: the per-test statuses a resolved episode gives (its expected_output_json); None: SWE-bench's
    # FAIL_TO_PASS / PASS_TO_PASS semantics
    expected_statuses: Mapping[str, str] | None = None
    # paths the image ships beside the repository that the agent must not see (R2E-Gym's run_tests.sh,
    # r2e_tests/): removed from the episode's copy, restored from the base at grading
    hidden_paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class RepoTask:
    task_id: str
    problem_statement: str
    # a directory, a .tar(.gz)/.tgz/.zip archive, or files; None: the repository the image ships at workdir
    snapshot: Path | Mapping[str, str] | None
    hidden_tests: tuple[CallTest, ...] | CommandTests
    meta: Mapping[str, Any] = field(default_factory=dict)
    # the environment image: an OCI layout / archive, a docker-save tarball or a root filesystem directory
    # (bwrap), or a container image reference (podman / docker / apptainer); "": the host's interpreter
    image: str = ""
    workdir: str = REPO_IN_JAIL  # where the repository is in the environment


@dataclass
class GradeResult:
    reward: float
    details: dict[str, Any]
