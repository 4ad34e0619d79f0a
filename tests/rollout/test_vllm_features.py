"""Options refused by the installed vLLM's version, and what doctor reports about it.

What each version offers is pinned in ``tests/compat/vllm/test_features.py``; here the project's
policy on top of it (``areal_npu/rollout/vllm_features.py``). The test leg in scripts/test.sh runs
this file in both virtualenvs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_npu.compat.vllm import features
from areal_npu.config import ConfigError
from areal_npu.rollout.config import RolloutConfig
from areal_npu.speculation.config import SpecConfig
from tests.compat.vllm.test_features import SEEN_0_23, SEEN_0_32, _installed_release

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pretend_version(monkeypatch):
    def pretend(version: str | None):
        monkeypatch.setattr(features, "installed_version", lambda: version)

    return pretend


def test_adaptive_speculation_is_refused_where_vllm_lacks_runtime_k(pretend_version):
    cfg = RolloutConfig(device="cpu", spec=SpecConfig(method="mtp", num_speculative_tokens=3, adaptive=True))
    pretend_version("0.23.0")
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.key == "spec.adaptive"
    assert "needs vLLM >= 0.32.0 (this is 0.23.0)" in str(err.value)
    pretend_version("0.32.0")
    cfg.validate()
    pretend_version(None)  # no vLLM here: nothing to refuse (no engine can start either)
    cfg.validate()


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
    assert set(report["features"]) == set(features.FEATURES)
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
