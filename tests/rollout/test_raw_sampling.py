"""An engine that returns raw log-probs refuses sampling that makes them wrong as π_behave: per-request
temperature / top-p / top-k on ``/areal/generate`` and, when a request asks for log-probs, on vLLM's
OpenAI routes (the model's generation-config defaults included); an engine that returns processed
log-probs takes them. Routes run in a FastAPI test client against the fake engine of
test_server_routes (no vLLM engine starts); the expected answers are written out by hand."""

from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from areal_npu.rollout import engine_state, generation_routes, guard, raw_sampling, server, vllm_features  # noqa: E402
from areal_npu.rollout.config import RolloutConfig  # noqa: E402
from areal_npu.speculation.config import SpecConfig  # noqa: E402
from tests.rollout.test_server_routes import LIMITS, SECRET, FakeEngine  # noqa: E402

SPEC = SpecConfig(method="mtp", num_speculative_tokens=2)


def areal_app(cfg: RolloutConfig, engine: FakeEngine, monkeypatch) -> TestClient:
    app = FastAPI()
    app.include_router(server.make_router(engine_state.EngineState(engine, cfg)))
    guard.install(app, SECRET, LIMITS)
    monkeypatch.setattr(  # the real SamplingParams needs vLLM; the route reads n from it
        generation_routes,
        "_sampling_params",
        lambda body, top_k: SimpleNamespace(body=body, top_k=top_k, n=body["n"]),
    )
    return TestClient(app, raise_server_exceptions=False, headers=guard.auth_headers(SECRET))


@pytest.mark.parametrize("processed", [True, False])
@pytest.mark.parametrize("spec", [SPEC, SpecConfig()], ids=["spec", "no-spec"])
def test_generate_refuses_a_transformed_distribution_only_where_log_probs_are_raw(
    monkeypatch, processed, spec
):
    monkeypatch.setattr(vllm_features, "processed_logprobs_checked", lambda: processed)
    raw = spec.enabled or not processed  # RolloutConfig.logprobs_mode, by hand
    engine = FakeEngine()
    http = areal_app(RolloutConfig(spec=spec), engine, monkeypatch)
    for sampling in ({"temperature": 0.7}, {"top_p": 0.9}, {"temperature": 1.3, "top_p": 0.95}):
        response = http.post("/areal/generate", json={"input_ids": [1], **sampling})
        if raw:
            field = next(iter(sampling))
            assert response.status_code == 400, response.text
            detail = response.json()["detail"]
            assert detail.startswith(f"{field} = {sampling[field]} is refused") and "raw log-probs" in detail
            assert ("speculative decoding (mtp)" if spec.enabled else "not checked") in detail, detail
        else:
            assert response.status_code == 200, response.text
    for neutral in ({}, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, {"temperature": 0.0}):  # 0: greedy
        assert http.post("/areal/generate", json={"input_ids": [1], **neutral}).status_code == 200
    assert len(engine.calls) == (0 if raw else 3) + 3  # a refused request never reaches the engine


def test_top_k_on_a_raw_engine_without_speculation_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_features, "processed_logprobs_checked", lambda: False)  # e.g. vLLM 0.23
    http = areal_app(RolloutConfig(), FakeEngine(), monkeypatch)
    response = http.post("/areal/generate", json={"input_ids": [1], "top_k": 20})
    assert response.status_code == 400 and response.json()["detail"].startswith("top_k = 20 is refused")
    # the engine's own rollout.top_k is the request's when it sends none
    http = areal_app(RolloutConfig(top_k=5), FakeEngine(), monkeypatch)
    assert http.post("/areal/generate", json={"input_ids": [1]}).status_code == 400


def openai_app(defaults=None) -> TestClient:
    """vLLM's side, reduced to one route that echoes the body it got; the raw-sampling guard inside the
    run's secret, as ``server.serve`` installs them."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return {"echo": await request.json()}

    raw_sampling.install(app, "speculative decoding (mtp) is on", defaults)
    guard.install(app, SECRET, LIMITS)
    return TestClient(app, raise_server_exceptions=False, headers=guard.auth_headers(SECRET))


@pytest.mark.parametrize(
    "body,field",
    [
        ({"logprobs": True, "temperature": 0.7}, "temperature"),
        ({"logprobs": True, "top_logprobs": 0, "top_p": 0.8}, "top_p"),
        ({"logprobs": 1, "top_k": 20}, "top_k"),
        ({"prompt_logprobs": 0, "presence_penalty": 1.5}, "presence_penalty"),
        ({"logprobs": True, "logit_bias": {"42": 5}}, "logit_bias"),
        ({"logprobs": True, "min_p": 0.05}, "min_p"),
    ],
)
def test_openai_route_asking_for_log_probs_of_a_transformed_distribution_is_refused(body, field):
    response = openai_app().post("/v1/chat/completions", json={"messages": [], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == 400 and "raw log-probs" in error["message"]


def test_openai_route_passes_what_it_may_unchanged_and_counts_the_models_defaults():
    http = openai_app()
    for body in (
        {"messages": [], "temperature": 0.7, "top_p": 0.8},  # no log-probs asked: sampled as asked
        {"messages": [], "logprobs": False, "temperature": 0.7},
        {"messages": [], "logprobs": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
        {"messages": [], "logprobs": True, "temperature": 0},  # greedy
    ):
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.json() == {"echo": body}, response.text
    # not JSON: not this guard's to judge; it reaches the route (which fails on it here: 500)
    assert http.post("/v1/chat/completions", content=b"{not json").status_code == 500
    # a model whose generation config samples at 0.6 (vLLM applies it to requests that omit it)
    tempered = openai_app({"temperature": 0.6, "top_p": 0.95})
    for body in ({"messages": [], "logprobs": True}, {"messages": [], "logprobs": True, "temperature": None}):
        response = tempered.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    body = {"messages": [], "logprobs": True, "temperature": 1.0, "top_p": 1.0}
    assert tempered.post("/v1/chat/completions", json=body).status_code == 200
    # the secret is checked first
    assert TestClient(tempered.app).post("/v1/chat/completions", json={"logprobs": True}).status_code == 401
