"""Print areal-npu's requirements (base dependencies plus the named extras) from pyproject.toml.

Used by docker/Dockerfile to install the dependencies in a layer of their own, before the code is
copied in, so that a code change does not reinstall them. Standard library only (Python >= 3.11).

    python3 pyproject_requirements.py pyproject.toml npu megatron --drop triton
"""

from __future__ import annotations

import argparse
import re
import sys

import tomllib


def requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised (PEP 503)."""
    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: dict, extras: list[str], drop: set[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    missing = [extra for extra in extras if extra not in optional]
    if missing:
        raise SystemExit(f"pyproject.toml has no extra named {', '.join(missing)}")
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs.extend(optional[extra])
    dropped = {requirement_name(name) for name in drop}
    return [req for req in reqs if requirement_name(req) not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("extras", nargs="*")
    parser.add_argument("--drop", action="append", default=[], help="leave out this distribution")
    args = parser.parse_args(argv)
    with open(args.pyproject, "rb") as f:
        data = tomllib.load(f)
    for req in requirements(data, args.extras, set(args.drop)):
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
