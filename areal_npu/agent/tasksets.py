"""Real repo-repair task sets on disk, in the SWE-bench / SWE-Gym JSONL layout (one JSON object a line).

Fields read from each row:

- ``instance_id`` (required): the task's name; also how its snapshot is found.
- ``problem_statement`` (required): the issue text the agent sees.
- ``test_patch``: a unified diff that adds the hidden tests (applied with ``git apply`` in a
  separate grading copy only; the agent's copy never has it).
- ``FAIL_TO_PASS`` / ``PASS_TO_PASS``: test ids that must pass after the fix, as a list or as
  SWE-bench's JSON-encoded string. Ids are as the runner prints them (pytest ``path::name``).
- ``test_command`` (optional, this project's addition): the shell command that runs the tests in
  the repository root. Default: ``python -m pytest -rA`` on the files the test patch touches.
- ``snapshot`` (optional): where the repository snapshot is, relative to the JSONL file's folder.
  Default: ``<snapshots>/<instance_id>`` (a directory) or ``<snapshots>/<instance_id>.tar.gz``
  / ``.tgz`` / ``.tar`` / ``.zip``.

Other fields (``repo``, ``base_commit``, ``version``, R2E-Gym's ``docker_image`` ...) are kept in
``RepoTask.meta`` untouched. SWE-bench rows carry no repository, and the jail has only the
interpreter's standard library: a task set whose tests need packages must ship them in the snapshot
(a container backend, which would install them, is not built).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from areal_npu.agent.environments import CommandTests, RepoTask

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_PATCHED_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.M)
_READ = {"instance_id", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "test_command",
         "snapshot"}  # fmt: skip


def _test_ids(value, field: str, line: int) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"line {line}: {field} must be a list of test ids")
    return tuple(value)


def _snapshot(row: dict, base: Path, snapshots: Path) -> Path:
    if row.get("snapshot"):
        return base / row["snapshot"]
    stem = snapshots / row["instance_id"]
    for candidate in [stem, *(stem.with_name(stem.name + s) for s in _ARCHIVE_SUFFIXES)]:
        if candidate.exists():
            return candidate
    raise ValueError(f"no snapshot for {row['instance_id']!r} under {snapshots}")


def load_jsonl(path: str | Path, snapshots: str | Path | None = None) -> list[RepoTask]:
    """Every row of ``path`` as a :class:`RepoTask`; ``snapshots`` defaults to the file's folder."""
    path = Path(path)
    snapshots = Path(snapshots) if snapshots else path.parent
    tasks = []
    for line, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        row = json.loads(text)
        for name in ("instance_id", "problem_statement"):
            if not isinstance(row.get(name), str) or not row[name]:
                raise ValueError(f"line {line}: {name} is required")
        patch = row.get("test_patch") or ""
        command = row.get("test_command")
        if not command:
            files = sorted(set(_PATCHED_FILE.findall(patch)))
            command = "python -m pytest -rA " + " ".join(shlex.quote(f) for f in files)
        tests = CommandTests(
            command=command,
            patch=patch,
            fail_to_pass=_test_ids(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS", line),
            pass_to_pass=_test_ids(row.get("PASS_TO_PASS"), "PASS_TO_PASS", line),
        )
        meta = {k: v for k, v in row.items() if k not in _READ}
        tasks.append(RepoTask(row["instance_id"], row["problem_statement"], _snapshot(row, path.parent, snapshots),
                              tests, meta))  # fmt: skip
    return tasks
