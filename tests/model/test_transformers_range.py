"""The transformers this run imports lies in the range pyproject.toml declares.

scripts/test.sh runs tests/model twice: in .venv (the top of the range) and with the lowest
supported version first on PYTHONPATH, setting AREAL_EXPECT_TRANSFORMERS so that a leg that
silently imported the wrong copy fails here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared_requirement() -> Requirement:
    lines = re.findall(r'^\s*"(transformers[^"]*)"', PYPROJECT.read_text(), flags=re.MULTILINE)
    assert len(lines) == 1, lines
    return Requirement(lines[0])


def test_imported_transformers_is_the_expected_one_and_in_range():
    version = transformers.__version__
    print(f"transformers {version} from {Path(transformers.__file__).parent}")
    requirement = declared_requirement()
    assert requirement.specifier.contains(Version(version)), f"{version} not in {requirement}"
    expected = os.environ.get("AREAL_EXPECT_TRANSFORMERS")
    if expected:
        assert Version(version) == Version(expected), f"expected transformers {expected}, imported {version}"
