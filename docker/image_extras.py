"""Check that the extras the images install cover what the recipes they launch call.

Reads docker/Dockerfile (the extras passed to pyproject_requirements.py) and the 64K recipes
(recipes/code_agent_64k/: the YAMLs and the launch script) and names every pyproject extra a recipe
needs that the image leaves out:

    python3 docker/image_extras.py                    # exit 1 naming what is missing
    python3 docker/image_extras.py --check-installed  # inside a built image: every distribution of
                                                      # those extras is installed

Standard library only (CI's image job has no PyYAML): the recipes are read line by line, the few
keys that decide an extra are matched by pattern. tests/docker/test_image_extras.py runs it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
RECIPES = "recipes/code_agent_64k"
# (file glob under RECIPES, pattern, extra, why): a line matching the pattern means the extra is needed.
NEEDS = (
    ("*.yaml", r"^device:\s*npu\b", "npu", "device: npu (torch-npu)"),
    ("*.yaml", r"^\s+backend:\s*megatron\b", "megatron", "train.backend: megatron (megatron-core)"),
    (
        "*.yaml",
        r"^\s+harness:.*\bmini_swe_agent\b",
        "agent",
        "workflow.shell.harness: mini_swe_agent (mini-swe-agent)",
    ),
    ("*.yaml", r"^\s+kind:\s*repo\b", "agent", "task.kind: repo (SWE-bench grading, swebench)"),
    (
        "_launch.sh",
        r"^LAUNCHER=\$\{LAUNCHER:-ray\}",
        "ray",
        "LAUNCHER=ray, the launch scripts' default (ray)",
    ),
    ("_launch.sh", r"^\s*RAY=\$\{RAY:-ray\}", "ray", "the launch scripts run `ray start` (ray)"),
)
INSTALL = re.compile(r"pyproject_requirements\.py\s+\S+pyproject\.toml((?:\s+[a-z][a-z0-9_-]*)+)")
DROP = re.compile(r"--drop\s+(\S+)")


def image_extras(dockerfile: str) -> tuple[list[str], list[str]]:
    """The extras docker/Dockerfile installs, and the distributions it drops from them."""
    text = re.sub(r"\\\n", " ", dockerfile)
    found = INSTALL.search(text)
    if found is None:
        raise ValueError("docker/Dockerfile does not run pyproject_requirements.py with extras")
    line = text[found.start() : text.index("\n", found.start())]
    return found.group(1).split(), DROP.findall(line)


def recipe_needs(root: Path = ROOT) -> dict[str, list[str]]:
    """extra -> the reasons (file: why) the recipes under RECIPES need it."""
    needs: dict[str, list[str]] = {}
    for glob, pattern, extra, why in NEEDS:
        for path in sorted((root / RECIPES).glob(glob)):
            if any(re.search(pattern, line) for line in path.read_text().splitlines()):
                needs.setdefault(extra, []).append(f"{path.name}: {why}")
    return needs


def missing(root: Path = ROOT, dockerfile: str | None = None) -> list[str]:
    """One line per extra a recipe needs that the image does not install (empty: all covered)."""
    text = (root / "docker" / "Dockerfile").read_text() if dockerfile is None else dockerfile
    installed, _ = image_extras(text)
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = []
    for extra, reasons in sorted(recipe_needs(root).items()):
        if extra not in declared:
            out.append(f"pyproject.toml has no extra {extra!r} ({reasons[0]})")
        elif extra not in installed:
            out.append(f"the images do not install the {extra!r} extra, which {'; '.join(reasons)} need(s)")
    return out


def not_installed(root: Path = ROOT) -> list[str]:
    """Inside a built image: distributions of the installed extras that are not installed."""
    extras, dropped = image_extras((root / "docker" / "Dockerfile").read_text())
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = []
    for extra in extras:
        for req in declared[extra]:
            name = re.split(r"[\s<>=!~;\[(@]", req.strip(), maxsplit=1)[0]
            if name in dropped:
                continue
            try:
                importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                out.append(f"{name} (extra {extra!r}) is not installed")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this file's)")
    parser.add_argument(
        "--check-installed", action="store_true", help="also check this Python's distributions"
    )
    args = parser.parse_args(argv)
    problems = missing(args.root) + (not_installed(args.root) if args.check_installed else [])
    for problem in problems:
        print(f"image_extras: {problem}", file=sys.stderr)
    if not problems:
        extras, _ = image_extras((args.root / "docker" / "Dockerfile").read_text())
        print(
            f"image_extras: OK: the images install {', '.join(extras)}; the recipes need "
            f"{', '.join(sorted(recipe_needs(args.root)))}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
