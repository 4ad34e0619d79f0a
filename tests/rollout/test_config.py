"""RolloutConfig / SpecConfig validation: every refusal names the field and says why."""

from __future__ import annotations

import json

import pytest

from areal_npu.config import ConfigError, load_config, validate_tree
from areal_npu.launch.engines import launch_engines
from areal_npu.rollout import vllm_features
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.config import MTP_ALIASES, SPEC_METHODS, SpecConfig


def cfg(**kwargs) -> RolloutConfig:
    spec = kwargs.pop("spec", SpecConfig())
    return RolloutConfig(model="/ckpt", device=kwargs.pop("device", "cpu"), spec=spec, **kwargs)


def test_defaults_are_valid_and_speculation_off():
    c = cfg()
    c.validate()
    assert not c.spec.enabled and c.spec.vllm_dict() is None
    assert "--speculative-config" not in c.vllm_cli_args(8000)


@pytest.mark.parametrize("method", ["mtp", "qwen3_5_mtp", "ngram"])
def test_spec_passthrough(method):
    c = cfg(spec=SpecConfig(method=method, num_speculative_tokens=3))
    c.validate()
    args = c.vllm_cli_args(8123)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == method and spec["num_speculative_tokens"] == 3 and spec["enforce_eager"] is True
    assert args[args.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert args[args.index("--port") + 1] == "8123" and args[args.index("--host") + 1] == "127.0.0.1"


def test_draft_model_methods_need_and_pass_a_path():
    with pytest.raises(ValueError, match=r"^draft_model .*eagle3"):
        SpecConfig(method="eagle3", num_speculative_tokens=2).validate()
    spec = SpecConfig(
        method="draft_model", num_speculative_tokens=2, draft_model="/draft", draft_enforce_eager=False
    )
    spec.validate()
    assert spec.vllm_dict() == {
        "method": "draft_model",
        "num_speculative_tokens": 2,
        "enforce_eager": False,
        "model": "/draft",
    }
    with pytest.raises(ValueError, match="^draft_model is only used"):
        SpecConfig(method="mtp", num_speculative_tokens=2, draft_model="/draft").validate()


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        SpecConfig(method="medusa2", num_speculative_tokens=2).validate()
    message = str(err.value)
    assert message.startswith("method 'medusa2'")
    for name in ("mtp", "qwen3_5_mtp", "draft_model", "eagle3", "ngram"):
        assert name in message


def test_k_limits():
    with pytest.raises(ValueError, match="^num_speculative_tokens must be >= 1"):
        SpecConfig(method="mtp", num_speculative_tokens=0).validate()
    # Ascend verifies at most 16 tokens per step: k + 1 <= 16
    cfg(device="npu", spec=SpecConfig(method="mtp", num_speculative_tokens=15)).validate()
    with pytest.raises(ConfigError) as err:
        cfg(device="npu", spec=SpecConfig(method="mtp", num_speculative_tokens=16)).validate()
    assert err.value.key == "spec.num_speculative_tokens" and "16" in str(err.value)
    cfg(device="cpu", spec=SpecConfig(method="mtp", num_speculative_tokens=16)).validate()  # no such limit


def test_top_k_with_speculation_is_refused():
    cfg(top_k=20).validate()  # fine without speculation
    with pytest.raises(ConfigError) as err:
        cfg(top_k=20, spec=SpecConfig(method="mtp", num_speculative_tokens=2)).validate()
    assert err.value.key == "top_k" and "top_p" in str(err.value)


def test_transport_per_device():
    assert cfg(device="cpu").resolved_transport() == "rpc"
    assert cfg(device="npu").resolved_transport() == "hccl"
    assert cfg(device="cuda").resolved_transport() == "nccl"
    with pytest.raises(ValueError, match="^weight_transport 'hccl' does not exist on cpu"):
        cfg(device="cpu", weight_transport="hccl").validate()
    cfg(device="cpu", weight_transport="gloo").validate()  # the broadcast on the CPU (the tests' path)
    with pytest.raises(ValueError, match="^weight_transport 'gloo' does not exist on npu"):
        cfg(device="npu", weight_transport="gloo").validate()
    with pytest.raises(ValueError, match="^weight_transport 'shm' unknown"):
        cfg(weight_transport="shm").validate()
    for ipc, device in (("cuda_ipc", "cuda"), ("npu_ipc", "npu")):  # nothing drives vLLM's IPC engines
        with pytest.raises(ConfigError) as err:
            cfg(device=device, weight_transport=ipc).validate()
        assert err.value.key == "weight_transport" and "not wired" in str(err.value)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_engines_never_listen_on_every_interface(host):
    with pytest.raises(ConfigError) as err:
        cfg(host=host).validate()
    assert err.value.key == "host" and "every interface" in str(err.value)
    cfg(host="10.0.0.2").validate()  # a node's address, as the plan names it


def test_weight_sync_retries():
    assert cfg().weight_sync_retries == 2
    cfg(weight_sync_retries=0).validate()
    with pytest.raises(ValueError, match="^weight_sync_retries"):
        cfg(weight_sync_retries=-1).validate()


def test_other_fields():
    RolloutConfig(device="cpu").validate()  # a recipe may leave the model to the trainer ...
    with pytest.raises(ValueError, match="^model "):  # ... but no engine starts without one
        launch_engines(RolloutConfig(device="cpu"))
    with pytest.raises(ValueError, match="^num_engines"):
        cfg(num_engines=0).validate()
    with pytest.raises(ValueError, match="^weight_bucket_bytes"):
        cfg(weight_bucket_bytes=10).validate()


def test_loads_from_yaml_with_dotted_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: /ckpt\ndevice: cpu\nspec:\n  method: mtp\n  num_speculative_tokens: 3\n")
    loaded = load_config(RolloutConfig, recipe, ["spec.num_speculative_tokens=4", "num_engines=2"])
    assert loaded.spec.num_speculative_tokens == 4 and loaded.num_engines == 2
    with pytest.raises(ConfigError) as err:
        load_config(RolloutConfig, recipe, ["spec.method=bogus"])
    assert err.value.key == "spec.method"
    validate_tree(loaded)


def test_round_trips_through_json():
    c = cfg(spec=SpecConfig(method="mtp", num_speculative_tokens=2), extra_engine_args={"max_num_seqs": 64})
    again = RolloutConfig.from_dict(json.loads(c.to_json()))
    assert again == c
    assert again.vllm_cli_args(1)[-2:] == ["--max-num-seqs", "64"]


def test_method_names_exist_in_vllm():
    speculative = pytest.importorskip("vllm.config.speculative")
    from typing import get_args

    def flatten(tp):
        for arg in get_args(tp):
            yield from flatten(arg) if get_args(arg) else [arg]

    valid = set(flatten(speculative.SpeculativeMethod))
    assert set(SPEC_METHODS) <= valid
    assert set(MTP_ALIASES) <= set(flatten(speculative.MTPModelTypes))


def test_without_speculation_the_engine_returns_the_sampled_distributions_logprobs():
    """processed_logprobs: log_softmax of what vLLM samples from (temperature, top-k, top-p applied);
    the values are checked against transformers in tests/rollout/test_engine.py."""
    args = cfg().vllm_cli_args(8000)
    want = "processed_logprobs" if vllm_features.processed_logprobs_checked() else "raw_logprobs"
    assert args[args.index("--logprobs-mode") + 1] == want


@pytest.mark.parametrize(
    "device, key, value, used",
    [("cpu", "gpu_memory_utilization", 0.5, "kv_cache_space_gib"),
     ("npu", "kv_cache_space_gib", 4, "gpu_memory_utilization"),
     ("cuda", "kv_cache_space_gib", 4, "gpu_memory_utilization")],
)  # fmt: skip
def test_the_other_devices_memory_key_is_refused(device, key, value, used):
    """Each device family sizes its KV cache with one key; the engine never sees the other."""
    c = cfg(device=device, **{key: value})
    with pytest.raises(ConfigError) as err:
        c.validate()
    assert err.value.key == key and used in str(err.value)
    c = cfg(device=device, **{used: {"kv_cache_space_gib": 4, "gpu_memory_utilization": 0.5}[used]})
    c.validate()
    seen = " ".join(c.vllm_cli_args(8000)) + json.dumps(c.engine_env())
    assert ("VLLM_CPU_KVCACHE_SPACE" in seen) == (device == "cpu")
    assert ("--gpu-memory-utilization 0.5" in seen) == (device != "cpu")


def test_a_vllm_whose_processed_logprobs_are_unchecked_returns_raw_ones(monkeypatch):
    from areal_npu.compat.vllm import features

    monkeypatch.setattr(features, "installed_version", lambda: "0.23.0")
    assert not vllm_features.processed_logprobs_checked()
    args = cfg().vllm_cli_args(8000)
    assert args[args.index("--logprobs-mode") + 1] == "raw_logprobs"
