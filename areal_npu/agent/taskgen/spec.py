"""The pinned description of a generated task set (``recipes/tasks/pylibs.yaml``): which libraries, at
which versions and sdist hashes, which of their files get bugs, how their suites run, and how many
tasks to keep. The description is data; the libraries' code is fetched from PyPI when the set is built.

The set's identity is the hash of the description's bytes and :data:`GENERATOR_VERSION`: the same
description always builds into the same cache folder, and a change to either rebuilds.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from areal_npu.config import ConfigError

GENERATOR_VERSION = 1  # bump when a build of the same description would now give different tasks
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class LibrarySpec:
    name: str  # the PyPI name
    version: str
    sha256: str  # of the sdist pip downloads
    repo: str  # upstream "owner/name", for the rows' ``repo`` field
    source_files: tuple[str, ...]  # mutated; relative to the sdist's top folder
    test_paths: tuple[str, ...]  # folders/files holding the suite: failing tests must be in these
    test_command: str  # run in the sdist's top folder; prints pytest's -rA summary
    tasks: int  # at most this many tasks kept

    @property
    def slug(self) -> str:
        """The instance-id stem: ``more-itertools`` -> ``more_itertools``."""
        return re.sub(r"[-.]+", "_", self.name).lower()


@dataclass(frozen=True)
class TaskSetSpec:
    name: str
    seed: int
    image: str  # the environment the tests run in (the rows' ``image`` field)
    libraries: tuple[LibrarySpec, ...]
    max_candidates: int  # mutations run per library at most
    max_fail_to_pass: int  # a mutation breaking more tests than this is too blunt to keep
    max_pass_to_pass: int  # PASS_TO_PASS ids listed per task at most
    timeout_s: float  # one suite run at most (a mutation that loops forever is cut off)
    digest: str  # sha256 of the description's bytes and the generator version

    @property
    def key(self) -> str:
        return f"{self.name}-{self.digest[:12]}"


def _require(raw: dict, key: str, kind: type, where: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{where}.{key}" if where else key, "is required")
    value = raw[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where}.{key}" if where else key, f"must be {kind.__name__}; got {value!r}")
    return value


def _relative_paths(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(key, f"must be a non-empty list of paths; got {value!r}")
    for v in value:
        path = PurePosixPath(v)
        if path.is_absolute() or ".." in path.parts:
            raise ConfigError(key, f"{v!r} must be relative to the sdist's top folder")
    return tuple(value)


def _library(raw: Any, index: int, default_tasks: int) -> LibrarySpec:
    where = f"libraries[{index}]"
    if not isinstance(raw, dict):
        raise ConfigError(where, f"must be a mapping; got {raw!r}")
    unknown = set(raw) - {
        "name",
        "version",
        "sha256",
        "repo",
        "source_files",
        "test_paths",
        "test_command",
        "tasks",
    }
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown key")
    name = _require(raw, "name", str, where)
    if not _NAME.match(name):
        raise ConfigError(f"{where}.name", f"not a PyPI name: {name!r}")
    sha = _require(raw, "sha256", str, where).lower()
    if not _SHA256.match(sha):
        raise ConfigError(f"{where}.sha256", f"must be 64 hex digits; got {sha!r}")
    tasks = raw.get("tasks", default_tasks)
    if isinstance(tasks, bool) or not isinstance(tasks, int) or tasks < 1:
        raise ConfigError(f"{where}.tasks", f"must be an int >= 1; got {tasks!r}")
    return LibrarySpec(
        name=name,
        version=str(_require(raw, "version", str, where)),
        sha256=sha,
        repo=_require(raw, "repo", str, where),
        source_files=_relative_paths(raw.get("source_files"), f"{where}.source_files"),
        test_paths=_relative_paths(raw.get("test_paths"), f"{where}.test_paths"),
        test_command=_require(raw, "test_command", str, where),
        tasks=tasks,
    )


def parse_spec(text: str, source: str = "<spec>") -> TaskSetSpec:
    """The description in ``text`` (YAML); a bad entry raises ConfigError naming its key."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: must be a mapping")
    known = {"name", "seed", "image", "tasks_per_library", "max_candidates", "max_fail_to_pass", "max_pass_to_pass",
             "timeout_s", "libraries"}  # fmt: skip
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown key")
    name = _require(raw, "name", str, "")
    if not _NAME.match(name):
        raise ConfigError("name", f"must be a plain name; got {name!r}")
    numbers = {}
    for key, default in (("tasks_per_library", 10), ("max_candidates", 80), ("max_fail_to_pass", 25),
                         ("max_pass_to_pass", 300), ("seed", 0)):  # fmt: skip
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "seed" else 1):
            raise ConfigError(key, f"must be an int >= {0 if key == 'seed' else 1}; got {value!r}")
        numbers[key] = value
    timeout = raw.get("timeout_s", 120)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ConfigError("timeout_s", f"must be a number > 0; got {timeout!r}")
    libraries = raw.get("libraries")
    if not isinstance(libraries, list) or not libraries:
        raise ConfigError("libraries", "must be a non-empty list")
    parsed = tuple(_library(lib, i, numbers["tasks_per_library"]) for i, lib in enumerate(libraries))
    slugs = [lib.slug for lib in parsed]
    for i, slug in enumerate(slugs):
        if slug in slugs[:i]:
            raise ConfigError(f"libraries[{i}].name", f"{parsed[i].name!r} is listed twice")
    digest = hashlib.sha256(text.encode("utf-8") + f"\ngenerator={GENERATOR_VERSION}".encode()).hexdigest()
    return TaskSetSpec(
        name=name,
        seed=numbers["seed"],
        image=str(raw.get("image", "")),
        libraries=parsed,
        max_candidates=numbers["max_candidates"],
        max_fail_to_pass=numbers["max_fail_to_pass"],
        max_pass_to_pass=numbers["max_pass_to_pass"],
        timeout_s=float(timeout),
        digest=digest,
    )


def select(spec: TaskSetSpec, names: list[str]) -> TaskSetSpec:
    """The spec with only the named libraries (a smaller set, e.g. CI's); its own cache key."""
    known = {lib.name: lib for lib in spec.libraries}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError("libraries", f"{unknown} are not in {spec.name}; it lists {', '.join(known)}")
    digest = hashlib.sha256(f"{spec.digest}\nlibraries={','.join(sorted(names))}".encode()).hexdigest()
    return replace(spec, libraries=tuple(known[n] for n in names), digest=digest)


def load_spec(path: str | Path) -> TaskSetSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the task-set description ({exc.strerror})") from exc
    return parse_spec(text, str(path))
