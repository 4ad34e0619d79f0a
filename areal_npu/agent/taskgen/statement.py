"""Issue-like problem statements for planted bugs: what a user would report, never the fix.

A statement names the library and version, the function whose behaviour broke and its module, how
many of the library's own tests now fail (by name), and what one or two of them print (the test's
failing line and its error, from pytest's FAILURES section). It never shows the mutation's kind,
line or text, nor library source lines.
"""

from __future__ import annotations

import random
from pathlib import PurePosixPath

from areal_npu.agent.taskgen.mutations import Mutation

_TITLES = (
    "`{func}` returns wrong results",
    "Regression in `{module}.{func}`",
    "`{module}.{func}` misbehaves",
    "Unexpected behaviour from `{func}`",
)
_OPENINGS = (
    "With {lib} {version} from a source checkout, `{func}` (in `{file}`) does not behave as documented.",
    "Something is off in `{module}`: `{func}` gives results the library's own tests do not expect.",
    "I ran {lib}'s own test suite and `{func}` (defined in `{file}`) appears to be broken.",
)
MAX_NAMED_TESTS = 5


def module_of(file: str) -> str:
    """``src/pkg/mod.py`` -> ``pkg.mod``; ``pkg/__init__.py`` -> ``pkg``."""
    parts = list(PurePosixPath(file).with_suffix("").parts)
    if parts and parts[0] == "src":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def public_name(qualname: str) -> str:
    """The name a user calls: the function that holds a nested def (``f.<locals>.g`` -> ``f``)."""
    return qualname.split(".<locals>.")[0]


def _short(test_id: str) -> str:
    return "::".join(test_id.split("::")[1:]) or test_id


def problem_statement(mutation: Mutation, lib: str, version: str, fail_to_pass: list[str],
                      excerpts: dict[str, str], seed: int) -> str:  # fmt: skip
    """The statement for one task; ``excerpts`` maps a failing test id to what it printed
    (:func:`areal_npu.agent.taskgen.suite.failure_excerpt`); the same inputs give the same text."""
    rng = random.Random(seed)
    fields = {"func": public_name(mutation.qualname), "module": module_of(mutation.file), "file": mutation.file,
              "lib": lib, "version": version}  # fmt: skip
    lines = [rng.choice(_TITLES).format(**fields), "", rng.choice(_OPENINGS).format(**fields), ""]
    named = ", ".join(f"`{_short(t)}`" for t in fail_to_pass[:MAX_NAMED_TESTS])
    more = f" and {len(fail_to_pass) - MAX_NAMED_TESTS} more" if len(fail_to_pass) > MAX_NAMED_TESTS else ""
    count = "One of the library's tests fails" if len(fail_to_pass) == 1 else (
        f"{len(fail_to_pass)} of the library's tests fail")  # fmt: skip
    lines += [f"{count}: {named}{more}. The rest of the suite still passes.", ""]
    shown = [t for t in fail_to_pass if excerpts.get(t)][:2]
    for test in shown:
        lines += [f"`{_short(test)}` fails with:", "", "```", excerpts[test], "```", ""]
    lines.append(f"Expected: `{fields['func']}` behaves as before, so that these tests pass again "
                 "without changing them.")  # fmt: skip
    return "\n".join(lines) + "\n"
