"""Embedded repo-repair tasks: a tiny Python package with one planted bug, a problem statement that
shows the failure, and hidden tests. No downloads; a pure function of ``(n, seed)``.

Each repository is ``toolkit/`` with two of three modules (``stats``, ``text``, ``seq``), each of
2-3 small functions, a README and visible unittest tests for the functions that are NOT broken. One
function carries one bug from a family (off-by-one, wrong operator, wrong comparison, wrong
return value, missing case, wrong constant, swapped operands, missing statement). The hidden tests
call the broken function on inputs where the bug shows (fail-to-pass) and every other function once
(pass-to-pass); expected values come from the correct source, which never enters the repository.
Sized for a tiny model: a repository is ~1.5 KB of code, and a fix is a one-line edit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areal_npu.agent.repo_task import CallTest, RepoTask
from areal_npu.config import ConfigError

PACKAGE = "toolkit"


@dataclass(frozen=True)
class _Function:
    module: str
    name: str
    source: str  # correct
    bugs: tuple[tuple[str, str, str], ...]  # (family, correct text, buggy text)
    sample: Callable[[random.Random], tuple]  # positional arguments


def _ints(rng, lo=2, hi=6, low=-9, high=9):
    return [rng.randint(low, high) for _ in range(rng.randint(lo, hi))]


def _word(rng, letters="abcdeiouxyzAEI", lo=1, hi=9):
    return "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))


FUNCTIONS = (
    _Function("stats", "mean", '''def mean(values):
    """Arithmetic mean of a non-empty list of numbers."""
    total = 0
    for v in values:
        total += v
    return total / len(values)
''', (("off_by_one", "total / len(values)", "total / (len(values) - 1)"),
      ("wrong_operator", "total += v", "total -= v")), lambda r: (_ints(r),)),
    _Function("stats", "clamp", '''def clamp(value, low, high):
    """value limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''', (("wrong_return", "        return high\n", "        return value\n"),
      ("wrong_comparison", "if value < low:", "if value > low:")),
        lambda r: (r.randint(-5, 15), 0, 10)),
    _Function("stats", "running_max", '''def running_max(values):
    """The largest value seen so far, at every position."""
    out = []
    best = None
    for v in values:
        if best is None or v > best:
            best = v
        out.append(best)
    return out
''', (("wrong_comparison", "v > best", "v < best"), ("wrong_return", "out.append(best)", "out.append(v)")),
        lambda r: (_ints(r, 3, 6),)),
    _Function("text", "count_vowels", '''def count_vowels(text):
    """How many characters are vowels (a, e, i, o, u; either case)."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''', (("missing_case", "text.lower()", "text"), ("wrong_constant", '"aeiou"', '"aeio"')),
        lambda r: (_word(r),)),
    _Function("text", "truncate", '''def truncate(text, width):
    """text cut to at most width characters; when cut, the last one kept is replaced by '~'."""
    if len(text) <= width:
        return text
    return text[: width - 1] + "~"
''', (("off_by_one", "text[: width - 1]", "text[:width]"),
      ("wrong_comparison", "len(text) <= width", "len(text) < width")),
        lambda r: (_word(r, "abcdefgh", 2, 9), r.randint(2, 7))),
    _Function("text", "initials", '''def initials(name):
    """Upper-case first letters of the words of name, joined by dots: 'ada lovelace' -> 'A.L'."""
    return ".".join(word[0].upper() for word in name.split())
''', (("wrong_constant", '".".join', '"".join'), ("missing_case", "word[0].upper()", "word[0]")),
        lambda r: (" ".join(_word(r, "abcdefgh", 2, 5) for _ in range(r.randint(2, 3))),)),
    _Function("seq", "chunk", '''def chunk(items, size):
    """items split into consecutive lists of length size (the last one may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]
''', (("off_by_one", "items[i : i + size]", "items[i : i + size - 1]"),
      ("wrong_operator", "range(0, len(items), size)", "range(0, len(items) - size, size)")),
        lambda r: (_ints(r, 3, 7, 0, 9), r.randint(2, 3))),
    _Function("seq", "rotate", '''def rotate(items, k):
    """items rotated left by k places: rotate([1, 2, 3], 1) == [2, 3, 1]."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]
''', (("swapped_operands", "items[k:] + items[:k]", "items[:k] + items[k:]"),
      ("missing_statement", "    k %= len(items)\n", "")),
        lambda r: (_ints(r, 2, 5, 0, 9), r.randint(1, 8))),
    _Function("seq", "dedupe", '''def dedupe(items):
    """items without repeats, first occurrences kept, in order."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
''', (("missing_statement", "            seen.add(item)\n", ""),
      ("wrong_comparison", "if item not in seen", "if item in seen")),
        lambda r: (_ints(r, 3, 7, 0, 4),)),
)  # fmt: skip
MODULES = ("stats", "text", "seq")
BUG_FAMILIES = tuple(sorted({family for f in FUNCTIONS for family, _, _ in f.bugs}))


def _call(source: str, name: str, args: tuple) -> tuple[str, Any]:
    """``("ok", value)`` or ``("raises", exception name)`` of the template function, run here."""
    scope: dict = {}
    exec(source, scope)  # our own template source, never a model's
    try:
        return "ok", scope[name](*args)
    except Exception as exc:  # noqa: BLE001 - a planted bug may raise; that is its symptom
        return "raises", type(exc).__name__


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _visible_test(fn: _Function, rng: random.Random) -> str:
    args = fn.sample(rng)
    _, value = _call(fn.source, fn.name, args)
    call = f"{fn.name}({', '.join(repr(a) for a in args)})"
    return f"    def test_{fn.name}(self):\n        self.assertEqual({call}, {value!r})\n"


def _make_task(rng: random.Random, index: int, seed: int, families: tuple[str, ...]) -> RepoTask:
    modules = sorted(rng.sample(MODULES, 2), key=MODULES.index)
    chosen = [f for f in FUNCTIONS if f.module in modules]
    candidates = [(f, b) for f in chosen for b in f.bugs if not families or b[0] in families]
    if not candidates:
        return _make_task(rng, index, seed, families)
    broken, (family, good, bad) = rng.choice(candidates)
    buggy_source = broken.source.replace(good, bad, 1)
    assert buggy_source != broken.source, (broken.name, family)
    fail_to_pass, shown = [], None
    for _ in range(500):  # inputs where the bug shows
        args = broken.sample(rng)
        right, wrong = _call(broken.source, broken.name, args), _call(buggy_source, broken.name, args)
        if right != wrong and right[0] == "ok":
            shown = shown or (args, right[1], wrong)
            if all(args != t.args for t in fail_to_pass):
                fail_to_pass.append(CallTest(f"{PACKAGE}.{broken.module}", broken.name, _plain(args),
                                             _plain(right[1])))  # fmt: skip
        if len(fail_to_pass) == 3:
            break
    pass_to_pass = []
    for fn in chosen:
        if fn is not broken:
            args = fn.sample(rng)
            pass_to_pass.append(CallTest(f"{PACKAGE}.{fn.module}", fn.name, _plain(args),
                                         _plain(_call(fn.source, fn.name, args)[1])))  # fmt: skip
    files = {"README.md": f"# {PACKAGE}\n\nSmall helpers: {', '.join(modules)}.\n"
             "Run the tests with `python -m unittest discover -s tests`.\n",
             f"{PACKAGE}/__init__.py": ""}  # fmt: skip
    for module in modules:
        sources = [buggy_source if f is broken else f.source for f in chosen if f.module == module]
        files[f"{PACKAGE}/{module}.py"] = "\n\n".join(sources)
        visible = [f for f in chosen if f.module == module and f is not broken]
        names = ", ".join(f.name for f in visible) or "*"
        body = "".join(_visible_test(f, rng) for f in visible) or "    pass\n"
        files[f"tests/test_{module}.py"] = (
            f"import unittest\n\nfrom {PACKAGE}.{module} import {names}\n\n\n"
            f"class Test{module.title()}(unittest.TestCase):\n{body}"
        )
    fixed = "\n\n".join(f.source for f in chosen if f.module == broken.module)
    args, right, (kind, wrong) = shown
    call = f"{PACKAGE}.{broken.module}.{broken.name}({', '.join(repr(a) for a in args)})"
    got = f"raises {wrong}" if kind == "raises" else f"returns {wrong!r}"
    statement = (f"`{call}` {got}, but it should return {right!r}. "
                 f"Fix the bug in `{PACKAGE}/{broken.module}.py` without changing other behaviour.")  # fmt: skip
    return RepoTask(
        task_id=f"synthetic-{seed}-{index}",
        problem_statement=statement,
        snapshot=files,
        hidden_tests=tuple(fail_to_pass + pass_to_pass),
        meta={"family": family, "function": f"{broken.module}.{broken.name}",
              "fix": {f"{PACKAGE}/{broken.module}.py": fixed},  # the reference solution
              "fail_to_pass": len(fail_to_pass), "pass_to_pass": len(pass_to_pass)},
    )  # fmt: skip


def make_repo_tasks(n: int, seed: int, families: tuple[str, ...] | list[str] = ()) -> list[RepoTask]:
    """``n`` tasks, a pure function of the arguments (its own ``random.Random``)."""
    if n < 1:
        raise ConfigError("n", f"must be >= 1; got {n}")
    unknown = [f for f in families if f not in BUG_FAMILIES]
    if unknown:
        raise ConfigError("families", f"{unknown} unknown; valid: {', '.join(BUG_FAMILIES)}")
    rng = random.Random(f"areal-npu-repo-tasks/{seed}")
    return [_make_task(rng, i, seed, tuple(families)) for i in range(n)]


def _identity(task: RepoTask) -> tuple:
    return task.problem_statement, tuple(sorted(task.snapshot.items()))


def make_repo_splits(
    n_train: int, n_eval: int, seed: int, families=(), dataset: str = "", image_root: str = "", snapshots: str = ""
) -> tuple[list[RepoTask], list[RepoTask]]:
    """Train and eval repo tasks; no eval task is also a train task. Embedded tasks by default; with
    ``dataset`` (SWE-bench / R2E-Gym instances on disk, :func:`areal_npu.agent.tasksets.load`) its
    first ``n_train`` instances train and the next ``n_eval`` evaluate."""
    if dataset:
        from areal_npu.agent.tasksets import load

        rows = load(dataset, snapshots or None, image_root or None)
        if len(rows) < n_train:
            raise ConfigError("n_train", f"is {n_train} but {dataset} has {len(rows)} tasks")
        return rows[:n_train], rows[n_train : n_train + n_eval]
    train = make_repo_tasks(n_train, seed, families)
    seen = {_identity(t) for t in train}
    pool = make_repo_tasks(2 * n_eval + 16, seed + 1_000_003, families)
    return train, [t for t in pool if _identity(t) not in seen][:n_eval]
