"""Real repo-repair task sets on disk: SWE-bench JSONL, swebench 5 task directories, R2E-Gym rows.

:func:`load` takes a path and returns :class:`~areal_npu.agent.repo_task.RepoTask`s:

- a ``.jsonl`` file, one instance a line, SWE-bench's columns (R2E-Gym's rows are recognised by
  their ``expected_output_json``);
- one task directory in swebench 5's layout (``task.yaml``, ``tests.json``, ``problem_statement.md``,
  ``test.patch`` ...; read with ``swebench.task.repo.load_task``), or a task repository holding many
  under ``tasks/``, or a directory of ``.jsonl`` files.

Fields read from each instance:

- ``instance_id``, ``problem_statement`` (required; an R2E-Gym row's id is ``<repo_name>__<commit[:8]>``);
- ``test_patch``: a unified diff that adds the hidden tests (applied in a grading copy only);
- ``FAIL_TO_PASS`` / ``PASS_TO_PASS``: test ids, a list or SWE-bench's JSON-encoded string;
- ``log_parser``: the swebench log parser that reads the test log (default ``pytest``);
- ``test_command`` (this project's): the shell command that runs the tests in the repository;
  default: ``python -m pytest -rA`` on the files the test patch touches (R2E-Gym: ``bash run_tests.sh``);
- the environment: ``image`` (or SWE-bench's ``image_name``, R2E-Gym's ``docker_image``): an OCI
  layout / archive or a root filesystem (bwrap backend), or an image reference (container
  backends); ``image_root`` (a folder) is prefixed to a relative one; ``workdir`` (default
  ``/testbed`` with an image, ``/repo`` without);
- ``snapshot``: the repository, relative to the file's folder; default ``<snapshots>/<instance_id>``
  (a directory or a .tar.gz/.tgz/.tar/.zip archive) when one exists there; none: the repository
  the image ships at ``workdir``. A task with neither is refused.

R2E-Gym rows are graded by their own field: reward 1 when the parsed per-test statuses equal
``expected_output_json``; their images' ``run_tests.sh`` and ``r2e_tests/`` are kept out of the
agent's copy (``hidden_paths``). Other fields are kept in ``RepoTask.meta`` untouched.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from areal_npu.agent.repo_task import REPO_IN_JAIL, TESTBED, CommandTests, RepoTask

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_PATCHED_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.M)
_IMAGE_FIELDS = ("image", "image_name", "docker_image")
_READ = {"instance_id", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "test_command",
         "snapshot", "log_parser", "workdir", "expected_output_json", *_IMAGE_FIELDS}  # fmt: skip
R2E_HIDDEN = ("run_tests.sh", "r2e_tests")


def _test_ids(value, field: str, where: str) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {field} must be a list of test ids")
    return tuple(value)


def _snapshot(row: dict, base: Path, snapshots: Path, has_image: bool, where: str) -> Path | None:
    if row.get("snapshot"):
        return base / row["snapshot"]
    stem = snapshots / row["instance_id"]
    for candidate in [stem, *(stem.with_name(stem.name + s) for s in _ARCHIVE_SUFFIXES)]:
        if candidate.exists():
            return candidate
    if has_image:
        return None  # the image ships the repository
    raise ValueError(f"{where}: no snapshot for {row['instance_id']!r} under {snapshots} and no image")


def _image(row: dict, base: Path, image_root: Path | None) -> str:
    image = next((row[k] for k in _IMAGE_FIELDS if row.get(k)), "")
    if not image or "://" in image:
        return image
    root = image_root if image_root is not None else base
    candidate = root / image.split(":")[0] if not Path(image).is_absolute() else None
    if candidate is not None and candidate.exists():  # a local OCI layout / archive / rootfs
        return str(root / image)
    return image  # a registry reference (container backends)


def from_row(row: dict, base: Path, snapshots: Path | None = None, image_root: Path | None = None,
             where: str = "") -> RepoTask:  # fmt: skip
    """One instance (a dict of SWE-bench / R2E-Gym columns) as a RepoTask; ``base``: the folder relative
    paths are read from."""
    if not row.get("instance_id") and row.get("expected_output_json") is not None and row.get("repo_name"):
        # R2E-Gym rows carry no id: its repository and commit name the instance
        row = {**row, "instance_id": f"{row['repo_name']}__{str(row.get('commit_hash', ''))[:8]}"}
    where = where or str(row.get("instance_id", "?"))
    for name in ("instance_id", "problem_statement"):
        if not isinstance(row.get(name), str) or not row[name]:
            raise ValueError(f"{where}: {name} is required")
    image = _image(row, base, image_root)
    patch = row.get("test_patch") or ""
    r2e = row.get("expected_output_json") is not None
    command = row.get("test_command")
    if not command:
        if r2e:
            command = "bash run_tests.sh"
        else:
            files = sorted(set(_PATCHED_FILE.findall(patch)))
            command = "python -m pytest -rA " + " ".join(shlex.quote(f) for f in files)
    expected = None
    if r2e:
        expected = row["expected_output_json"]
        expected = json.loads(expected) if isinstance(expected, str) else expected
        if not isinstance(expected, dict):
            raise ValueError(f"{where}: expected_output_json must map test names to statuses")
    tests = CommandTests(
        command=command,
        patch=patch,
        fail_to_pass=_test_ids(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS", where),
        pass_to_pass=_test_ids(row.get("PASS_TO_PASS"), "PASS_TO_PASS", where),
        log_parser=row.get("log_parser") or "pytest",
        expected_statuses=expected,
        hidden_paths=R2E_HIDDEN if r2e else (),
    )
    meta = {k: v for k, v in row.items() if k not in _READ}
    snapshot = _snapshot(row, base, snapshots or base, bool(image), where)
    workdir = row.get("workdir") or (TESTBED if image else REPO_IN_JAIL)
    return RepoTask(row["instance_id"], row["problem_statement"], snapshot, tests, meta, image=image,
                    workdir=workdir)  # fmt: skip


def load_jsonl(path: str | Path, snapshots: str | Path | None = None, image_root: str | Path | None = None
               ) -> list[RepoTask]:  # fmt: skip
    """Every row of ``path`` as a :class:`RepoTask`; ``snapshots`` defaults to the file's folder."""
    path = Path(path)
    snaps = Path(snapshots) if snapshots else path.parent
    root = Path(image_root) if image_root else None
    tasks = []
    for line, text in enumerate(path.read_text().splitlines(), start=1):
        if text.strip():
            tasks.append(from_row(json.loads(text), path.parent, snaps, root, where=f"{path}:{line}"))
    return tasks


def load(path: str | Path, snapshots: str | Path | None = None, image_root: str | Path | None = None
         ) -> list[RepoTask]:  # fmt: skip
    """A task set at ``path``: a JSONL file, a swebench 5 task directory or task repository, or a folder
    of JSONL files. A clear ValueError when it is none of these or holds no task."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"task set {path} does not exist")
    if path.is_file():
        tasks = load_jsonl(path, snapshots, image_root)
    elif (path / "task.yaml").is_file() or (path / "tasks").is_dir():
        from swebench.task.repo import load_task, load_task_repo  # 2-3 s to import: only when needed

        rows = [load_task(path)] if (path / "task.yaml").is_file() else load_task_repo(path)
        root = Path(image_root) if image_root else None
        tasks = [from_row(r, path, Path(snapshots) if snapshots else path, root) for r in rows]
    else:
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ValueError(f"{path} is neither a JSONL file, a swebench task directory (task.yaml) or task "
                             "repository (tasks/), nor a folder of .jsonl files")  # fmt: skip
        tasks = [t for f in files for t in load_jsonl(f, snapshots, image_root)]
    if not tasks:
        raise ValueError(f"task set {path} holds no task")
    return tasks
