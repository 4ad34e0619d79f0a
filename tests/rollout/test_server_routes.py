"""The engine's ``/areal`` routes refuse bad bodies with 400 naming the field, before the engine
is touched. The routes run in a FastAPI test client against a fake engine that records its calls
(no vLLM engine starts); the expected answers are written out by hand."""

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")  # the server's dependency (vLLM brings it on engine nodes)
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from areal_npu.rollout import request_body, server  # noqa: E402
from areal_npu.rollout.client import RolloutClient  # noqa: E402
from areal_npu.rollout.config import RolloutConfig, SpecConfig  # noqa: E402
from areal_npu.spec import k_driver  # noqa: E402

K_MAX = 3


class FakeEngine:
    """Records every call the routes make; generates two tokens per sample."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return [7] if name == "collective_rpc" else None

        return record

    async def generate(self, prompt, params, request_id):
        self.calls.append(("generate", (prompt, params, request_id), {}))
        ids = [5, 6]
        steps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        outputs = [
            SimpleNamespace(index=i, token_ids=ids, logprobs=steps, finish_reason="length", spec_decode_metrics=None)
            for i in range(params.n)
        ]
        yield SimpleNamespace(outputs=outputs)


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def http(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(k_driver.ENV_FILE, str(tmp_path / "k"))
    cfg = RolloutConfig(spec=SpecConfig(method="mtp", num_speculative_tokens=K_MAX, adaptive=True))
    app = FastAPI()
    app.include_router(server.make_router(server.EngineState(engine, cfg)))
    # the real SamplingParams needs vLLM; the routes only read ``n`` from it
    monkeypatch.setattr(
        server, "_sampling_params", lambda body, top_k: SimpleNamespace(body=body, top_k=top_k, n=body["n"])
    )
    return TestClient(app, raise_server_exceptions=False)


BAD = [
    # (path, body: dict | list | bytes, field named in the answer)
    ("/areal/generate", {}, "input_ids"),
    ("/areal/generate", {"input_ids": "1 2 3"}, "input_ids"),
    ("/areal/generate", {"input_ids": [1, 2.5]}, "input_ids"),
    ("/areal/generate", {"input_ids": [1, -2]}, "input_ids"),
    ("/areal/generate", {"input_ids": []}, "input_ids"),
    ("/areal/generate", {"input_ids": [1], "max_tokens": "7"}, "max_tokens"),
    ("/areal/generate", {"input_ids": [1], "max_tokens": 0}, "max_tokens"),
    ("/areal/generate", {"input_ids": [1], "n": True}, "n"),
    ("/areal/generate", {"input_ids": [1], "temperature": "hot"}, "temperature"),
    ("/areal/generate", {"input_ids": [1], "top_p": 0}, "top_p"),
    ("/areal/generate", {"input_ids": [1], "top_k": 5}, "top_k"),  # speculation is on
    ("/areal/generate", {"input_ids": [1], "stop_token_ids": 2}, "stop_token_ids"),
    ("/areal/generate", {"input_ids": [1], "ignore_eos": "no"}, "ignore_eos"),
    ("/areal/generate", {"input_ids": [1], "seed": 1.5}, "seed"),
    ("/areal/generate", {"input_ids": [1], "request_id": 3}, "request_id"),
    ("/areal/generate", {"input_ids": [1], "max_new_tokens": 8}, "max_new_tokens"),
    ("/areal/generate", b"{not json", "body"),
    ("/areal/generate", [1, 2], "body"),
    ("/areal/pause", {"mode": "drop"}, "mode"),
    ("/areal/resume", {"mode": "keep"}, "mode"),
    ("/areal/spec_k", {}, "k"),
    ("/areal/spec_k", {"k": "2"}, "k"),
    ("/areal/spec_k", {"k": K_MAX + 1}, "k"),
    ("/areal/update_weights/begin", {"version": 1}, "version"),
    ("/areal/update_weights/bucket?target=critic", b"\x00" * 8, "target"),
    ("/areal/update_weights/bucket", b"", "body"),
    ("/areal/update_weights/commit", {"version": "3"}, "version"),
    ("/areal/update_weights/commit", {"version": -1}, "version"),
    ("/areal/update_weights/collective/init", {}, "init_info"),
    ("/areal/update_weights/collective/init", {"init_info": [1]}, "init_info"),
    ("/areal/update_weights/collective/start", {"target": "critic"}, "target"),
    ("/areal/update_weights/collective/chunk", {}, "update_info"),
    ("/areal/update_weights/collective/chunk", {"update_info": "x"}, "update_info"),
    ("/areal/update_weights/collective/finish", {"target": "draft"}, "target"),
    ("/areal/debug/param_sums?target=critic", None, "target"),
]


def _post(http, path, body):
    if body is None or isinstance(body, bytes):
        return http.post(path, content=body or b"")
    return http.post(path, json=body)


@pytest.mark.parametrize("path,body,field", BAD, ids=[f"{p}-{f}" for p, _, f in BAD])
def test_bad_body_answers_400_naming_the_field_and_leaves_the_engine_alone(http, engine, path, body, field):
    response = _post(http, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith(f"{field} "), response.json()
    assert engine.calls == []


def test_every_post_route_is_covered():
    state = SimpleNamespace(cfg=RolloutConfig())
    router = server.make_router(state)  # the router's own routes: newer FastAPI nests included ones
    posted = {r.path for r in router.routes if "POST" in getattr(r, "methods", ())}
    covered = {path.split("?")[0] for path, _, _ in BAD}
    assert posted == covered


def test_good_generate_reaches_the_engine_with_its_values(http, engine):
    response = http.post("/areal/generate", json={"input_ids": [3, 4], "n": 2, "max_tokens": 2, "seed": 9})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["prompt_len"] == 2 and len(data["samples"]) == 2
    assert data["samples"][0]["output_ids"] == [5, 6] and data["samples"][0]["logprobs"] == [-0.5, -0.5]
    [(name, (prompt, params, _), _)] = engine.calls
    assert name == "generate" and prompt == {"prompt_token_ids": [3, 4]}
    expected = {
        "input_ids": [3, 4], "request_id": None, "n": 2, "temperature": 1.0, "top_p": 1.0, "top_k": None,
        "max_tokens": 2, "stop_token_ids": None, "ignore_eos": False, "seed": 9,
    }  # fmt: skip
    assert params.body == expected and params.top_k == 0


def test_good_weight_update_goes_through(http, engine):
    assert http.post("/areal/update_weights/begin", json={}).status_code == 200
    response = http.post("/areal/update_weights/bucket?target=draft", content=b"\x01" * 16)
    assert response.status_code == 200 and response.json() == {"loaded": 7}
    response = http.post("/areal/update_weights/commit", json={"version": 4})
    assert response.status_code == 200 and response.json()["version"] == 4
    names = [name for name, _, _ in engine.calls]
    assert names[0] == "pause_generation" and names[-1] == "resume_generation"
    assert http.post("/areal/spec_k", json={"k": 0}).json() == {"k": 0}


def test_generate_defaults_match_the_client():
    """The server fills in what the client would have sent (the client's keyword defaults)."""
    client_defaults = {
        name: p.default
        for name, p in inspect.signature(RolloutClient.generate).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    for name, field in request_body.GENERATE.items():
        if name in ("input_ids", "top_k", "stop_token_ids", "request_id"):  # required, or None: the
            continue  # engine's setting / none
        assert field.default == client_defaults[name], name


def test_sampling_params_from_a_validated_body():
    pytest.importorskip("vllm")
    body = request_body.validate({"input_ids": [1], "temperature": 0.5, "stop_token_ids": [2]}, request_body.GENERATE)
    params = server._sampling_params(body, 0)
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (1, 0.5, 1.0, 256)
    assert params.stop_token_ids == [2] and params.seed is None


def test_request_vllm_refuses_answers_400_not_500(http, engine, monkeypatch):
    """vLLM's own request validation (a prompt past max_model_len, ...) is the caller's fault."""
    exceptions = pytest.importorskip("vllm.exceptions")

    async def refuse(prompt, params, request_id):
        raise exceptions.VLLMValidationError("The decoder prompt (length 9) is longer than the maximum")
        yield  # an async generator, like AsyncLLM.generate

    monkeypatch.setattr(engine, "generate", refuse, raising=False)
    response = http.post("/areal/generate", json={"input_ids": [1] * 9})
    assert response.status_code == 400 and "longer than the maximum" in response.json()["detail"]
