"""The engine's ``/areal`` routes behind the guard: 401 without the run's secret and 413 past the
body limit, before the engine is touched; bad bodies refused with 400 naming the field; weight
updates staged until a complete commit, and an engine with partly loaded weights kept paused. The
routes run in a FastAPI test client against a fake engine that records its calls (no vLLM engine
starts); the expected answers are written out by hand."""

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")  # the server's dependency (vLLM brings it on engine nodes)
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from areal_npu.rollout import engine_state, generation_routes, guard, request_body, server  # noqa: E402
from areal_npu.rollout.buckets import pack_bucket  # noqa: E402
from areal_npu.rollout.client import RolloutClient  # noqa: E402
from areal_npu.rollout.config import RolloutConfig  # noqa: E402
from areal_npu.speculation import k_driver  # noqa: E402
from areal_npu.speculation.config import SpecConfig  # noqa: E402

K_MAX = 3
SECRET = "run-secret"
LIMITS = guard.BodyLimits(bucket=64 << 10, other=8 << 10)


class FakeEngine:
    """Records every call the routes make; generates two tokens per sample. ``failing``: worker
    methods (``collective_rpc`` names) that raise; ``prefix_reset``: what ``reset_prefix_cache``
    answers (vLLM: True when the cache was reset)."""

    def __init__(self):
        self.calls = []
        self.failing: set[str] = set()
        self.prefix_reset = True

    def __getattr__(self, name):
        async def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "collective_rpc" and args[0] in self.failing:
                raise RuntimeError(f"{args[0]} failed")
            if name == "reset_prefix_cache":
                return self.prefix_reset
            return [7] if name == "collective_rpc" else None

        return record

    def names(self):
        """Engine calls, worker methods by their own name."""
        return [args[0] if name == "collective_rpc" else name for name, args, _ in self.calls]

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
    cfg = RolloutConfig(
        enable_prefix_caching=True, spec=SpecConfig(method="mtp", num_speculative_tokens=K_MAX, adaptive=True)
    )
    cfg.spec.validate()  # as the engine process does (server.main)
    app = FastAPI()
    app.include_router(server.make_router(engine_state.EngineState(engine, cfg)))
    app.middleware_stack = app.build_middleware_stack()  # as vLLM's app setup leaves it
    guard.install(app, SECRET, LIMITS)
    # the real SamplingParams needs vLLM; the routes only read ``n`` from it
    monkeypatch.setattr(
        generation_routes, "_sampling_params", lambda body, top_k: SimpleNamespace(body=body, top_k=top_k, n=body["n"])
    )
    return TestClient(app, raise_server_exceptions=False, headers=guard.auth_headers(SECRET))


def bucket(**tensors):
    import torch

    return pack_bucket([(name, torch.full((4,), float(v))) for name, v in tensors.items()])


LAYOUT = {"nbytes": 64, "tensors": [["model.norm.weight", "float32", [4], 0]]}
GROUP = {"backend": "gloo", "host": "127.0.0.1", "port": 29000, "prefix": "p", "world_size": 2,
         "rank_offset": 1, "timeout_s": 30.0}  # fmt: skip


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
    ("/areal/spec_k", {"k": 1, "by_context": [K_MAX + 1]}, "by_context"),
    ("/areal/update_weights/begin", {"version": 1}, "version"),
    ("/areal/update_weights/bucket?target=critic", b"\x00" * 8, "target"),
    ("/areal/update_weights/bucket", b"", "body"),
    ("/areal/update_weights/bucket", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", "body"),
    ("/areal/update_weights/commit", {"version": "3"}, "version"),
    ("/areal/update_weights/commit", {"version": -1}, "version"),
    ("/areal/update_weights/commit", {"expect": {"critic": 1}}, "expect"),
    ("/areal/update_weights/commit", {"expect": {"policy": -1}}, "expect"),
    ("/areal/update_weights/abort", {"version": 1}, "version"),
    ("/areal/update_weights/collective/init", {}, "group"),
    ("/areal/update_weights/collective/init", {"group": [1]}, "group"),
    ("/areal/update_weights/collective/init", {"group": {**GROUP, "backend": "mpi"}}, "group"),
    ("/areal/update_weights/collective/init", {"group": {**GROUP, "rank_offset": 0}}, "group"),
    ("/areal/update_weights/collective/bucket", {"layout": LAYOUT, "target": "critic"}, "target"),
    ("/areal/update_weights/collective/bucket", {}, "layout"),
    ("/areal/update_weights/collective/bucket", {"layout": {"nbytes": 8, "tensors": [["w", "float32", [4], 16]]}},
     "layout"),
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


def test_good_weight_update_is_staged_then_applied_at_the_commit(http, engine):
    assert http.post("/areal/update_weights/begin", json={}).status_code == 200
    response = http.post("/areal/update_weights/bucket?target=policy", content=bucket(a=1, b=2))
    assert response.status_code == 200 and response.json() == {"staged": 2}
    response = http.post("/areal/update_weights/bucket?target=draft", content=bucket(**{"mtp.c": 3}))
    assert response.status_code == 200 and response.json() == {"staged": 1}
    assert engine.calls == []  # staged: the engine generates on, untouched
    response = http.post("/areal/update_weights/commit", json={"version": 4, "expect": {"policy": 2, "draft": 1}})
    assert response.status_code == 200 and response.json()["version"] == 4
    assert engine.names() == [
        "pause_generation",
        "areal_begin_update", "areal_load_bucket", "areal_finish_update",  # policy
        "areal_begin_update", "areal_load_bucket", "areal_finish_update",  # drafter
        "reset_prefix_cache",  # after the last tensor, before anything runs again
        "resume_generation",
    ]  # fmt: skip
    assert engine.calls[-2][2] == {"reset_running_requests": True}  # frozen requests hold blocks
    assert http.get("/areal/version").json()["version"] == 4
    assert http.post("/areal/spec_k", json={"k": 0}).json() == {"k": 0}


def test_an_incomplete_or_abandoned_update_changes_nothing(http, engine):
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 2}})
    assert response.status_code == 409 and "nothing applied" in response.json()["detail"]
    assert http.post("/areal/update_weights/commit", json={"version": 1}).status_code == 409  # session gone
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    assert http.post("/areal/update_weights/abort", json={}).json() == {"version": 0, "dirty": None}
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    http.post("/areal/update_weights/begin", json={})  # a new session drops the staged one
    http.post("/areal/update_weights/bucket", content=bucket(b=1))
    assert engine.calls == []
    state = http.get("/areal/version").json()
    assert state["version"] == 0 and state["dirty"] is None
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 1}})
    assert response.status_code == 200 and engine.names().count("areal_load_bucket") == 1


def test_a_failed_broadcast_keeps_the_engine_paused_until_a_whole_update(http, engine):
    engine.failing.add("areal_receive_bucket")
    http.post("/areal/update_weights/begin", json={})
    response = http.post("/areal/update_weights/collective/bucket", json={"target": "policy", "layout": LAYOUT})
    assert response.status_code == 500 and "areal_receive_bucket failed" in response.json()["detail"]
    assert engine.names() == ["pause_generation", "areal_begin_update", "areal_receive_bucket",
                              "areal_finish_update"]  # fmt: skip  # paused, the workers' reload closed
    state = http.get("/areal/version").json()
    assert state["version"] == 0 and "broadcast failed" in state["dirty"]
    # nothing is generated from partly loaded weights, and nobody resumes the engine
    assert http.post("/areal/generate", json={"input_ids": [1]}).status_code == 503
    assert http.post("/areal/resume", json={}).status_code == 409
    # a commit must carry the dirty target whole
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket?target=draft", content=bucket(**{"mtp.a": 1}))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"draft": 1}})
    assert response.status_code == 409 and "policy weights are partly loaded" in response.json()["detail"]
    assert "resume_generation" not in engine.names()
    engine.failing.clear()
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1, b=2))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 2}})
    assert response.status_code == 200
    assert engine.names()[-2:] == ["reset_prefix_cache", "resume_generation"]
    state = http.get("/areal/version").json()
    assert state["version"] == 1 and state["dirty"] is None
    assert http.post("/areal/generate", json={"input_ids": [1]}).status_code == 200


def test_a_failed_apply_at_the_commit_leaves_the_engine_paused(http, engine):
    engine.failing.add("areal_load_bucket")
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 1}})
    assert response.status_code == 500
    assert engine.names()[0] == "pause_generation" and "resume_generation" not in engine.names()
    state = http.get("/areal/version").json()
    assert state["version"] == 0 and "applying the update failed" in state["dirty"]


def test_a_broadcast_commit_resets_the_prefix_cache_before_resuming(http, engine):
    http.post("/areal/update_weights/begin", json={})
    for target in ("policy", "draft"):
        body = {"target": target, "layout": LAYOUT}
        assert http.post("/areal/update_weights/collective/bucket", json=body).status_code == 200
    assert "reset_prefix_cache" not in engine.names()  # nothing is reset before the last tensor
    commit = {"version": 2, "expect": {"policy": 7, "draft": 7}}  # the fake worker loads 7 tensors a bucket
    response = http.post("/areal/update_weights/commit", json=commit)
    assert response.status_code == 200, response.text
    assert engine.names() == [
        "pause_generation",
        "areal_begin_update", "areal_receive_bucket", "areal_finish_update",  # policy
        "areal_begin_update", "areal_receive_bucket", "areal_finish_update",  # drafter, closed by the commit
        "reset_prefix_cache",
        "resume_generation",
    ]  # fmt: skip


def test_a_prefix_cache_vllm_did_not_reset_fails_the_commit_and_keeps_the_engine_paused(http, engine):
    engine.prefix_reset = False  # vLLM's answer while some request still holds cache blocks
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 1}})
    assert response.status_code == 500 and "did not reset its prefix cache" in response.json()["detail"]
    assert "resume_generation" not in engine.names()
    state = http.get("/areal/version").json()
    assert state["version"] == 0 and "prefix cache" in state["dirty"]
    assert http.post("/areal/generate", json={"input_ids": [1]}).status_code == 503
    assert http.post("/areal/resume", json={}).status_code == 409
    engine.prefix_reset = True  # the trainer's retry: the whole update again, and this time the reset holds
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 1}})
    assert response.status_code == 200
    assert engine.names()[-2:] == ["reset_prefix_cache", "resume_generation"]
    state = http.get("/areal/version").json()
    assert state["version"] == 1 and state["dirty"] is None


def test_without_prefix_caching_a_commit_resets_nothing(engine):
    cfg = RolloutConfig(enable_prefix_caching=False)
    app = FastAPI()
    app.include_router(server.make_router(engine_state.EngineState(engine, cfg)))
    http = TestClient(app, raise_server_exceptions=False)
    http.post("/areal/update_weights/begin", json={})
    http.post("/areal/update_weights/bucket", content=bucket(a=1))
    response = http.post("/areal/update_weights/commit", json={"version": 1, "expect": {"policy": 1}})
    assert response.status_code == 200
    assert "reset_prefix_cache" not in engine.names() and engine.names()[-1] == "resume_generation"


def _routes():
    router = server.make_router(SimpleNamespace(cfg=RolloutConfig()))
    return [(method, r.path) for r in router.routes for method in sorted(getattr(r, "methods", ()))]


def test_without_the_secret_every_route_is_refused_before_anything_runs(http, engine):
    routes = _routes() + [("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/scale_elastic_ep"),
                          ("GET", "/metrics"), ("GET", "/anything/vllm/adds/later")]  # fmt: skip
    assert len(routes) > 15
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}"}):
        for method, path in routes:
            body = bucket(a=1) if path.endswith("/bucket") else b'{"input_ids": [1]}'
            response = http.request(method, path, content=body, headers=headers)
            assert response.status_code == 401, (method, path, response.status_code)
    assert engine.calls == []
    assert http.get("/health", headers={"Authorization": ""}).status_code != 401  # open for probes


def test_an_oversized_body_is_refused_with_413(http, engine):
    huge = bucket(**{f"w{i}": i for i in range(10)}) + b"\x00" * LIMITS.bucket
    http.post("/areal/update_weights/begin", json={})
    response = http.post("/areal/update_weights/bucket", content=huge)
    assert response.status_code == 413 and "larger than" in response.json()["detail"]
    response = http.post("/areal/generate", json={"input_ids": [1] * (LIMITS.other // 2)})
    assert response.status_code == 413

    def stream():  # no Content-Length: refused once the stream passes the limit
        for _ in range(LIMITS.other // 1024 + 2):
            yield b" " * 1024

    response = http.post("/areal/generate", content=stream())
    assert response.status_code == 413
    response = http.post("/areal/update_weights/bucket", content=bucket(a=1))  # within the limit
    assert response.status_code == 200
    assert engine.calls == []


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
    params = generation_routes._sampling_params(body, 0)
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
