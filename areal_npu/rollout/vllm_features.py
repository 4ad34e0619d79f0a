"""What the rollout layer does about the installed vLLM: options refused by version, and doctor's list.

What vLLM offers is :mod:`areal_npu.compat.vllm.features` (version -> feature map, no project
imports); this module is the project's policy on top of it, which needs :class:`ConfigError`.

What 0.23 lacks, and what the rollout layer does about it (each option is refused at config time
with the version named, or given a 0.23 path -- never accepted and ignored):

* ``entrypoints_launchers`` -- 0.32 moved the OpenAI server's building blocks into
  ``vllm.entrypoints.launchers``; 0.23 has them in ``vllm.entrypoints.openai.api_server``
  (the server imports from whichever exists: same functions).
* ``dynamic_spec_tokens`` -- ``num_speculative_tokens_per_batch_size``, behind runtime ``k``
  (``speculation/k_driver.py``): ``spec.adaptive`` is refused on 0.23.
* ``per_request_spec_metrics`` -- ``--per-request-spec-decode-metrics``: on 0.23 a sample's
  ``spec`` is null; acceptance comes from the engine counters (``/areal/metrics``), which 0.23 has.
* ``qwen3_5_text_class`` -- 0.23 serves Qwen3.5 only in the published (VL) layout: a checkpoint
  saved as ``Qwen3_5ForCausalLM`` is refused by vLLM itself ("not supported for now").
* ``draft_model_accessor`` -- ``Worker.get_draft_model``: on 0.23 the worker extension reaches the
  drafter through the model runner's proposer (``drafter.model``) and reloads it with the same
  layer-wise helpers (0.23 has them: ``layerwise_reload``).
* ``cpu_hybrid_speculation`` -- 0.23's CPU Gated DeltaNet kernel asserts "speculative decode not
  supported": speculation on a hybrid model is refused on the CPU with 0.23 (``recipe.py``).

The weight transports need nothing version-specific beyond ``layerwise_reload`` and
``collective_rpc``: RPC buckets and the collective broadcast (``collective.py``) load through the
worker extension on both versions; vLLM's own weight-transfer engines are not used.
"""

from __future__ import annotations

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.config import ConfigError

#: What a user can switch on in the rollout section, and the features each needs (doctor's list).
ROLLOUT_OPTIONS: dict[str, tuple[str, ...]] = {
    "engine server (/areal routes, updates that keep in-flight requests)": ("pause_keep",),
    "weight sync of policy and MTP drafter (rpc buckets)": ("layerwise_reload",),
    "spec.adaptive (runtime draft length k)": ("dynamic_spec_tokens",),
    "per-request acceptance summaries (samples' spec)": ("per_request_spec_metrics",),
    "weight_transport hccl / nccl / gloo (broadcast of policy and MTP drafter)": ("layerwise_reload",),
    "MTP speculation on a hybrid (Gated DeltaNet) model on the CPU": ("cpu_hybrid_speculation",),
}


#: The oldest vLLM whose processed log-probs (temperature, top-k, top-p applied: the distribution it
#: samples from) are checked against transformers (tests/rollout/test_engine.py); 0.23, the images',
#: is not checked, so its engines return raw log-probs and a recipe keeps temperature 1 there.
PROCESSED_LOGPROBS_SINCE = (0, 32, 0)


def processed_logprobs_checked() -> bool:
    """Whether the installed vLLM's processed log-probs are checked (False without vLLM)."""
    version = vllm_version.installed_version()
    return version is not None and vllm_version.parse_version(version) >= PROCESSED_LOGPROBS_SINCE


def require(name: str, option: str, why: str) -> None:
    """Refuse ``option`` (a config key) when the installed vLLM lacks feature ``name``.

    No-op when vLLM is not installed here: then no engine can start either, and the launcher says so.
    """
    version = vllm_version.installed_version()
    if version is None or vllm_version.has(name):
        return
    raise ConfigError(option, f"{why} needs vLLM >= {vllm_version.since_text(name)} (this is {version})")


def usable_options(flags: dict[str, bool]) -> dict[str, bool]:
    """:data:`ROLLOUT_OPTIONS` -> whether every feature it needs is in ``flags``."""
    return {option: all(flags[name] for name in needs) for option, needs in ROLLOUT_OPTIONS.items()}


def summary() -> dict:
    """What doctor reports under ``vllm``: ``version``, ``features`` (name -> bool) and
    ``rollout_options`` (what this install can use)."""
    flags = vllm_version.features()
    return {"version": vllm_version.installed_version(), "features": flags, "rollout_options": usable_options(flags)}
