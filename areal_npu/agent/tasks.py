"""The embedded default task: tiny program synthesis from input→output examples, no downloads.

Each task shows a few examples of a hidden function and asks for its body as ONE Python expression in
``x``::

    prompt:  "f(2)=5 f(3)=7 f(6)=13\\nf(x)="      answer: "2*x+1"
    prompt:  "f('ab')='ba' f('cat')='tac'\\nf(x)="  answer: "x[::-1]"

The answer is graded by running ``def f(x): return <answer>`` in the sandbox on hidden tests (inputs
the prompt does not show). Levels: ``easy`` (one operation with at most one small constant: sized so a
~1M-parameter byte-level model learns it in minutes on a CPU; prompts ≤ 60 bytes, answers ≤ 16),
``medium`` (two constants or two operations), ``hard`` (compositions). Everything is a pure function
of ``(n, seed, level)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_npu.config import ConfigError

LEVELS = ("easy", "medium", "hard")
STOP_MARKERS = ("\n", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>")
_LETTERS = "abcdefgh"


def _int(lo: int, hi: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(lo, hi)


def _word(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(lo, hi)))


def _digits(rng: random.Random, lo: int = 2, hi: int = 4) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(lo, hi))]


@dataclass(frozen=True)
class _Family:
    """A template: ``answer.format(*params)`` computes ``fn(params)(x)`` on inputs from ``sample``."""

    name: str
    answer: str
    fn: Callable[..., Callable[[Any], Any]]
    sample: Callable[[random.Random], Any]
    params: tuple[Callable[[random.Random], Any], ...] = ()


def _short_word(rng: random.Random) -> str:
    return _word(rng, 2, 3)


def _short_digits(rng: random.Random) -> list[int]:
    return _digits(rng, 2, 3)


_SMALL_INT = _int(0, 9)
_MED_INT = _int(0, 20)
FAMILIES: dict[str, tuple[_Family, ...]] = {
    "easy": (
        _Family("add", "x+{}", lambda a: lambda x: x + a, _SMALL_INT, (_int(1, 9),)),
        _Family("sub", "x-{}", lambda a: lambda x: x - a, _SMALL_INT, (_int(1, 9),)),
        _Family("mul", "{}*x", lambda a: lambda x: a * x, _SMALL_INT, (_int(2, 9),)),
        _Family("square", "x*x", lambda: lambda x: x * x, _SMALL_INT),
        _Family("upper", "x.upper()", lambda: lambda x: x.upper(), _short_word),
        _Family("reverse", "x[::-1]", lambda: lambda x: x[::-1], _short_word),
        _Family("double", "x+x", lambda: lambda x: x + x, _short_word),
        _Family("strlen", "len(x)", lambda: lambda x: len(x), _short_word),
        _Family("first", "x[0]", lambda: lambda x: x[0], _short_word),
        _Family("sum", "sum(x)", lambda: lambda x: sum(x), _short_digits),
        _Family("max", "max(x)", lambda: lambda x: max(x), _short_digits),
        _Family("min", "min(x)", lambda: lambda x: min(x), _short_digits),
    ),
    "medium": (
        _Family("affine", "{}*x+{}", lambda a, b: lambda x: a * x + b, _MED_INT, (_int(2, 9), _int(1, 9))),
        _Family("mod", "x%{}", lambda a: lambda x: x % a, _MED_INT, (_int(2, 9),)),
        _Family("floordiv", "x//{}", lambda a: lambda x: x // a, _MED_INT, (_int(2, 9),)),
        _Family("square_add", "x*x+{}", lambda a: lambda x: x * x + a, _SMALL_INT, (_int(1, 9),)),
        _Family("prefix", "x[:{}]", lambda a: lambda x: x[:a], lambda r: _word(r, 3, 5), (_int(1, 2),)),
        _Family("repeat", "x*{}", lambda a: lambda x: x * a, lambda r: _word(r, 1, 3), (_int(2, 3),)),
        _Family("last", "x[-1]", lambda: lambda x: x[-1], _word),
        _Family("rev_upper", "x[::-1].upper()", lambda: lambda x: x[::-1].upper(), _word),
        _Family("scaled_sum", "sum(x)*{}", lambda a: lambda x: sum(x) * a, _digits, (_int(2, 9),)),
        _Family("spread", "max(x)-min(x)", lambda: lambda x: max(x) - min(x), _digits),
        _Family("rev_list", "x[::-1]", lambda: lambda x: x[::-1], _digits),
        _Family("sorted", "sorted(x)", lambda: lambda x: sorted(x), _digits),
    ),
    "hard": (
        _Family(
            "shift_scale", "(x+{})*{}", lambda a, b: lambda x: (x + a) * b, _MED_INT, (_int(1, 9), _int(2, 9))
        ),
        _Family(
            "quad",
            "x*x+{}*x+{}",
            lambda a, b: lambda x: x * x + a * x + b,
            _SMALL_INT,
            (_int(1, 9), _int(1, 9)),
        ),
        _Family("mod_add", "x%{}+{}", lambda a, b: lambda x: x % a + b, _MED_INT, (_int(2, 9), _int(1, 9))),
        _Family("sum_len", "sum(x)+len(x)", lambda: lambda x: sum(x) + len(x), _digits),
        _Family("desc", "sorted(x)[::-1]", lambda: lambda x: sorted(x)[::-1], _digits),
        _Family(
            "add_each", "[v+{} for v in x]", lambda a: lambda x: [v + a for v in x], _digits, (_int(1, 9),)
        ),
        _Family("palin", "x+x[::-1]", lambda: lambda x: x + x[::-1], _word),
        _Family(
            "count", "x.count('{}')", lambda c: lambda x: x.count(c), _word, (lambda r: r.choice("abc"),)
        ),
    ),
}


@dataclass(frozen=True)
class Task:
    """One item. ``examples`` are shown in the prompt; ``tests`` are hidden (other inputs)."""

    level: str
    family: str
    params: tuple
    examples: tuple[tuple[Any, Any], ...]
    tests: tuple[tuple[Any, Any], ...]
    answer: str  # the canonical reference answer (an expression in x)


@dataclass
class TaskConfig:
    n_train: int = 2000
    n_eval: int = 200
    seed: int = 1
    level: str = "easy"
    n_examples: int = 3
    n_tests: int = 5
    # a subset of the level's families (kind repo: of the bug families); empty: all
    families: list[str] = field(default_factory=list)
    # program: the embedded program-synthesis tasks | repo: repo-repair tasks for the shell agent
    # (areal_npu.agent.repo_tasks: embedded, or a dataset on disk)
    kind: str = "program"
    # kind repo: a SWE-bench / R2E-Gym task set (a JSONL file, a swebench 5 task directory or a folder of
    # either; areal_npu.agent.tasksets); empty: the embedded repo tasks
    dataset: str = ""
    # kind repo with a dataset: the folder a task's relative image (OCI layout / archive / root filesystem)
    # is looked up in; empty: the dataset's own folder. Images that are not there are registry references.
    image_root: str = ""
    # kind repo with a dataset: where <instance_id>[.tar.gz|.zip] snapshots lie; empty: the dataset's folder
    snapshots: str = ""

    def validate(self) -> None:
        for name in ("n_train", "n_eval", "n_examples", "n_tests"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1; got {getattr(self, name)!r}")
        if self.kind == "repo":
            self._validate_repo()
            return
        if self.kind != "program":
            raise ConfigError("kind", f"must be program or repo; got {self.kind!r}")
        for name in ("dataset", "image_root", "snapshots"):
            if getattr(self, name):
                raise ConfigError(name, "is read with kind: repo only")
        if self.n_examples > 4:
            raise ConfigError("n_examples", f"must be <= 4 (prompts must stay short); got {self.n_examples}")
        if self.n_tests > 32:
            raise ConfigError("n_tests", f"must be <= 32; got {self.n_tests}")
        if self.level not in LEVELS:
            raise ConfigError("level", f"must be one of {', '.join(LEVELS)}; got {self.level!r}")
        known = [f.name for f in FAMILIES[self.level]]
        unknown = [f for f in self.families if f not in known]
        if unknown:
            raise ConfigError("families", f"{unknown} not in level {self.level!r}; valid: {', '.join(known)}")

    def _validate_repo(self) -> None:
        from areal_npu.agent.repo_tasks import BUG_FAMILIES

        default = TaskConfig()
        for name in ("level", "n_examples", "n_tests"):
            if getattr(self, name) != getattr(default, name):
                raise ConfigError(name, "is a program-task option; kind repo does not read it")
        if not self.dataset:
            for name in ("image_root", "snapshots"):
                if getattr(self, name):
                    raise ConfigError(name, "is read with a task.dataset only")
        if self.dataset:
            if self.families:
                raise ConfigError("families", "selects embedded repo tasks; a dataset is used whole")
            for name in ("dataset", "image_root", "snapshots"):
                if getattr(self, name) and not Path(getattr(self, name)).exists():
                    raise ConfigError(name, f"{getattr(self, name)!r} does not exist")
            return
        unknown = [f for f in self.families if f not in BUG_FAMILIES]
        if unknown:
            raise ConfigError("families", f"{unknown} are not bug families; valid: {', '.join(BUG_FAMILIES)}")


def _make_task(rng: random.Random, level: str, n_examples: int, n_tests: int, families=()) -> Task:
    pool = [f for f in FAMILIES[level] if f.name in families] if families else FAMILIES[level]
    family = rng.choice(pool)
    params = tuple(p(rng) for p in family.params)
    fn = family.fn(*params)
    seen: set[str] = set()
    inputs: list[Any] = []
    for _ in range(200):  # small input spaces: stop early with what there is (>= 1 hidden test)
        x = family.sample(rng)
        if repr(x) not in seen:
            seen.add(repr(x))
            inputs.append(x)
        if len(inputs) == n_examples + n_tests:
            break
    pairs = tuple((x, fn(x)) for x in inputs)
    return Task(
        level, family.name, params, pairs[:n_examples], pairs[n_examples:], family.answer.format(*params)
    )


def make_dataset(
    n: int, seed: int, level: str = "easy", n_examples: int = 3, n_tests: int = 5, families=()
) -> list[Task]:
    """``n`` tasks, a pure function of the arguments (its own ``random.Random``, never the global one)."""
    TaskConfig(
        n_train=max(n, 1),
        seed=seed,
        level=level,
        n_examples=n_examples,
        n_tests=n_tests,
        families=list(families),
    ).validate()
    rng = random.Random(f"areal-npu-program-tasks/{level}/{seed}")
    return [_make_task(rng, level, n_examples, n_tests, families) for _ in range(n)]


def make_splits(cfg: TaskConfig) -> tuple[list[Task], list[Task]]:
    """Train and eval sets; eval prompts never appear in train. ``kind: repo`` gives ``RepoTask``s."""
    cfg.validate()
    if cfg.kind == "repo":
        from areal_npu.agent.repo_tasks import make_repo_splits

        return make_repo_splits(cfg.n_train, cfg.n_eval, cfg.seed, cfg.families, cfg.dataset, cfg.image_root,
                                cfg.snapshots)
    train = make_dataset(cfg.n_train, cfg.seed, cfg.level, cfg.n_examples, cfg.n_tests, cfg.families)
    seen = {format_prompt(t) for t in train}
    pool = make_dataset(
        4 * cfg.n_eval + 64, cfg.seed + 1_000_003, cfg.level, cfg.n_examples, cfg.n_tests, cfg.families
    )
    return train, [t for t in pool if format_prompt(t) not in seen][: cfg.n_eval]


def format_prompt(task: Task) -> str:
    """``f(2)=5 f(3)=7 f(6)=13\\nf(x)=``: the examples with Python reprs, then the question."""
    shown = " ".join(f"f({x!r})={y!r}".replace(", ", ",") for x, y in task.examples)
    return f"{shown}\nf(x)="


def extract_program(completion_text: str) -> str:
    """The answer expression: the completion up to the first line break or end marker, stripped.

    Every line break ``str.splitlines`` knows ends the line (``\r``, ``\f``, ``\x1c``...), not just
    ``\n``: Python's tokenizer reads a bare ``\r`` as a newline, so cutting at ``\n`` only would let
    a "one-line" answer carry more statements."""
    text = completion_text.splitlines()[0] if completion_text else ""
    for marker in STOP_MARKERS:
        text = text.split(marker, 1)[0]
    text = text.strip()
    return text[len("f(x)=") :].strip() if text.startswith("f(x)=") else text


def to_program(answer: str) -> str:
    """Source the sandbox runs: an expression becomes the body of ``f``; empty stays empty."""
    return f"def f(x):\n    return {answer}\n" if answer.strip() else ""


def sft_pairs(tasks: list[Task]) -> list[tuple[str, str]]:
    """Warm-start pairs ``(prompt, completion)``; the completion is the reference answer plus ``\\n``,
    so a model learns to stop where :func:`extract_program` cuts."""
    return [(format_prompt(t), t.answer + "\n") for t in tasks]
