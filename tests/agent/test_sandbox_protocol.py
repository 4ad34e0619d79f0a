"""The parent's reading of child frames: untrusted bytes in, a decoded frame or None out, never an
exception; and the honest-program verdicts of the grader before the jail, reproduced exactly."""

import json
import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu.agent.reward import reward_many
from areal_npu.agent.sandbox import SandboxLimits
from areal_npu.agent.sandbox_protocol import parse_frame, same_value
from areal_npu.agent.tasks import extract_program, make_dataset

NONCE = "ab" * 16


def _frame(obj) -> bytes:
    return NONCE.encode() + b" " + json.dumps(obj).encode() + b"\n"


def test_a_well_formed_frame_decodes_with_tagged_floats():
    raw = _frame(
        {
            "results": [{"ok": [1, "a", None, True, 2.5]}, {"ok": {"float": "-inf"}}, {"err": "KeyError"}],
            "reason": "",
            "layers": ["rlimits"],
        }
    )
    frame = parse_frame(raw, NONCE, 3)
    assert frame["results"][0] == ("ok", [1, "a", None, True, 2.5])
    assert frame["results"][1] == ("ok", -math.inf) and frame["results"][2] == ("err", "KeyError")


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=400)
    | st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.floats(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=30,
    ).map(lambda obj: _frame({"results": obj, "reason": ""}) if not isinstance(obj, bytes) else obj)
)
def test_any_bytes_give_a_frame_or_none_never_an_exception(raw):
    frame = parse_frame(raw, NONCE, 2)
    assert frame is None or len(frame["results"]) == 2


def test_deep_nesting_and_wrong_nonce_are_refused():
    assert parse_frame(NONCE.encode() + b" " + b"[" * 100_000 + b"\n", NONCE, 1) is None
    deep = {"results": [{"ok": json.loads("[" * 500 + "]" * 500)}], "reason": ""}
    assert parse_frame(_frame(deep), NONCE, 1) is None
    assert (
        parse_frame(_frame({"results": [{"ok": 1}], "reason": ""}).replace(b"ab", b"cd", 1), NONCE, 1) is None
    )
    assert parse_frame(_frame({"results": [{"ok": 1}], "reason": ""}) * 2, NONCE, 1) is None


def test_same_value_is_exact_and_nan_equals_nan():
    assert same_value(math.nan, math.nan) and same_value([1, [2.0]], [1, [2.0]])
    assert not same_value("nan", math.nan) and not same_value(1, True) and not same_value(1.0, 1)
    assert not same_value(math.inf, "inf") and not same_value([1], [1, 2])


def test_line_breaks_other_than_newline_end_the_answer():
    for brk in ("\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x85", "\u2028"):
        assert extract_program(f"2*x+1{brk}__import__('os')") == "2*x+1"
    task = make_dataset(1, 0, "easy")[0]
    smuggled = "0\r    return " + task.answer  # would be a second statement to Python's tokenizer
    ((score, _),) = reward_many([task], [smuggled], 1, SandboxLimits(wall_seconds=20))
    assert score < 1.0


def test_honest_programs_grade_exactly_as_before_the_jail():
    """The verdicts in data/ were recorded with the grader at commit 5e83ba8 (before the jail) on
    the same programs and limits; the jailed grader must reproduce every one of them."""
    recorded = json.loads((Path(__file__).parent / "data" / "previous_grader_verdicts.json").read_text())
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=20, memory_bytes=256 << 20, output_bytes=8192)
    by_level = {}
    for case in recorded["cases"]:
        by_level.setdefault(
            case["level"], make_dataset(recorded["n_per_level"], recorded["seed"], case["level"])
        )
    tasks = [by_level[c["level"]][c["index"]] for c in recorded["cases"]]
    got = reward_many(tasks, [c["answer"] for c in recorded["cases"]], 2, limits)
    want = [(c["passed"] / c["total"], c["reason"]) for c in recorded["cases"]]
    assert got == want
    assert len(want) > 150 and {r for _, r in want} >= {"ok", "wrong_answer", "crash", "syntax_error"}
