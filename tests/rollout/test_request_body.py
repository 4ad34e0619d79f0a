"""The body rules of the engine's routes, without FastAPI: expected values written out by hand."""

import pytest

from areal_npu.rollout.request_body import (
    COMMIT,
    GENERATE,
    NOTHING,
    BodyError,
    parse,
    spec_k_fields,
    validate,
)


def test_defaults_are_filled_and_given_values_kept():
    got = validate({"input_ids": [0, 9], "top_p": 0.5, "seed": None}, GENERATE)
    assert got == {
        "input_ids": [0, 9], "request_id": None, "n": 1, "temperature": 1.0, "top_p": 0.5, "top_k": None,
        "max_tokens": 256, "stop_token_ids": None, "ignore_eos": False, "seed": None,
    }  # fmt: skip


@pytest.mark.parametrize(
    "raw,fields,message",
    [
        (b"", COMMIT, None),  # empty body means {}
        (b"{}", NOTHING, None),
        (b'{"x": 1}', NOTHING, "x is not a field of this route (accepted: none)"),
        (b"[]", NOTHING, "body must be a JSON object; got list"),
        (b"\xff", NOTHING, "body is not valid JSON"),
        (b'{"version": true}', COMMIT, "version must be an integer; got true"),
        (b'{"version": 1.0}', COMMIT, "version must be an integer; got 1.0"),
        (b'{"input_ids": [1, true]}', GENERATE, "input_ids must be a list of non-negative integer token ids"),
        (b'{"input_ids": [1], "temperature": NaN}', GENERATE, "temperature must be a finite number"),
        (b'{"input_ids": [1], "temperature": -0.1}', GENERATE, "temperature must be >= 0; got -0.1"),
        (b'{"input_ids": [1], "top_p": 1.5}', GENERATE, "top_p must be in (0, 1]; got 1.5"),
        (b'{"input_ids": [1], "n": null}', GENERATE, "n must be an integer; got null"),
        (b"{}", GENERATE, "input_ids is required (a list of non-negative integer token ids)"),
        (b'{"k": 4}', spec_k_fields(3), "k must be an integer in [0, 3]; got 4"),
    ],
)
def test_parse(raw, fields, message):
    if message is None:
        parse(raw, fields)
        return
    with pytest.raises(BodyError) as info:
        parse(raw, fields)
    assert str(info.value).startswith(message)
    assert info.value.field == message.split()[0]
