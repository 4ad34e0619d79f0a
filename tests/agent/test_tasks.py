"""The embedded program-synthesis task, checked against an oracle written independently here."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu.agent.tasks import (
    LEVELS,
    TaskConfig,
    extract_program,
    format_prompt,
    make_dataset,
    make_splits,
    sft_pairs,
    to_program,
)
from areal_npu.config import ConfigError

# The meaning of every family, restated without the module's templates: (params, x) -> output.
ORACLE = {
    "add": lambda p, x: x + p[0],
    "sub": lambda p, x: x - p[0],
    "mul": lambda p, x: x * p[0],
    "square": lambda p, x: x**2,
    "upper": lambda p, x: "".join(chr(ord(c) - 32) for c in x),
    "reverse": lambda p, x: "".join(reversed(x)),
    "double": lambda p, x: 2 * x,
    "strlen": lambda p, x: sum(1 for _ in x),
    "first": lambda p, x: x[:1],
    "sum": lambda p, x: sum(x),
    "max": lambda p, x: sorted(x)[-1],
    "min": lambda p, x: sorted(x)[0],
    "sorted": lambda p, x: sorted(x),
    "affine": lambda p, x: p[0] * x + p[1],
    "mod": lambda p, x: x - p[0] * (x // p[0]),
    "floordiv": lambda p, x: int(x / p[0]),
    "square_add": lambda p, x: x**2 + p[0],
    "prefix": lambda p, x: x[0 : p[0]],
    "repeat": lambda p, x: "".join([x] * p[0]),
    "last": lambda p, x: x[len(x) - 1],
    "rev_upper": lambda p, x: "".join(reversed(x)).upper(),
    "scaled_sum": lambda p, x: p[0] * sum(x),
    "spread": lambda p, x: sorted(x)[-1] - sorted(x)[0],
    "rev_list": lambda p, x: list(reversed(x)),
    "shift_scale": lambda p, x: p[1] * x + p[0] * p[1],
    "quad": lambda p, x: x**2 + p[0] * x + p[1],
    "mod_add": lambda p, x: x % p[0] + p[1],
    "sum_len": lambda p, x: sum(v + 1 for v in x),
    "desc": lambda p, x: sorted(x, reverse=True),
    "add_each": lambda p, x: [v + p[0] for v in x],
    "palin": lambda p, x: x + "".join(reversed(x)),
    "count": lambda p, x: sum(c == p[0] for c in x),
}


def _run_answer(answer: str, x):
    """The reference answer evaluated in-process (the sandbox is checked in test_sandbox.py)."""
    scope: dict = {}
    exec(to_program(answer), scope)
    return scope["f"](x)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), level=st.sampled_from(LEVELS))
def test_outputs_match_the_oracle_and_the_reference_answer(seed, level):
    for task in make_dataset(12, seed, level):
        assert len(task.examples) == 3 and 1 <= len(task.tests) <= 5
        for x, y in task.examples + task.tests:
            assert y == ORACLE[task.family](task.params, x)
            got = _run_answer(task.answer, x)
            assert type(got) is type(y) and got == y
        shown = {repr(x) for x, _ in task.examples}
        assert not shown & {repr(x) for x, _ in task.tests}, "hidden tests must use unseen inputs"


@pytest.mark.parametrize("level", LEVELS)
def test_sizes_fit_a_tiny_byte_level_model(level):
    tasks = make_dataset(3000, 7, level)
    prompt_cap, answer_cap = (60, 16) if level == "easy" else (96, 20)
    assert max(len(format_prompt(t).encode()) for t in tasks) <= prompt_cap
    assert max(len(t.answer.encode()) for t in tasks) <= answer_cap
    assert all(len(t.tests) == 5 for t in tasks)
    assert len({t.family for t in tasks}) >= 8  # every template of the level shows up
    assert len({format_prompt(t) for t in tasks}) > 0.5 * len(tasks)


def test_determinism_by_seed():
    for level in LEVELS:
        assert make_dataset(50, 3, level) == make_dataset(50, 3, level)
        assert make_dataset(50, 3, level) != make_dataset(50, 4, level)
    assert make_dataset(20, 3, "easy") == make_dataset(40, 3, "easy")[:20]


def test_prompt_format():
    task = next(t for t in make_dataset(200, 1, "easy") if t.family == "add")
    (x0, y0), (x1, y1), (x2, y2) = task.examples
    assert format_prompt(task) == f"f({x0})={y0} f({x1})={y1} f({x2})={y2}\nf(x)="
    task = next(t for t in make_dataset(200, 1, "easy") if t.family == "sum")
    assert " " not in format_prompt(task).split(" ")[0]  # lists are written without spaces


@pytest.mark.parametrize(
    "completion, program",
    [
        ("2*x+1\nf(5)=11", "2*x+1"),
        ("  x[::-1]  \n", "x[::-1]"),
        ("sum(x)<|endoftext|>junk", "sum(x)"),
        ("x.upper()</s>", "x.upper()"),
        ("f(x)=x+3\n", "x+3"),
        ("", ""),
        ("\nx+1", ""),
    ],
)
def test_extract_program(completion, program):
    assert extract_program(completion) == program


def test_to_program_wraps_an_expression():
    scope: dict = {}
    exec(to_program("x*x"), scope)
    assert scope["f"](7) == 49
    assert to_program("  ") == ""


def test_sft_pairs_round_trip_through_extraction():
    tasks = make_dataset(30, 2, "medium")
    pairs = sft_pairs(tasks)
    assert [p for p, _ in pairs] == [format_prompt(t) for t in tasks]
    assert all(c.endswith("\n") and extract_program(c) == t.answer for (_, c), t in zip(pairs, tasks))


def test_splits_are_disjoint_and_sized():
    train, evals = make_splits(TaskConfig(n_train=500, n_eval=100, seed=5))
    assert len(train) == 500 and len(evals) == 100
    assert not {format_prompt(t) for t in train} & {format_prompt(t) for t in evals}


@pytest.mark.parametrize(
    "field, value",
    [
        ("n_train", 0),
        ("n_eval", -1),
        ("n_examples", 0),
        ("n_examples", 9),
        ("n_tests", 0),
        ("level", "expert"),
    ],
)
def test_config_validation_names_the_field(field, value):
    cfg = TaskConfig(**{field: value})
    with pytest.raises(ValueError) as info:
        cfg.validate()
    assert str(info.value).startswith(field)
    assert isinstance(info.value, ConfigError)
    TaskConfig().validate()
