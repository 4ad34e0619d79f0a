"""Typed configuration of speculative decoding (``rollout.spec`` in a recipe).

``validate()`` raises ``ValueError`` / ``ConfigError`` whose message starts with the field name, and
resolves the adaptive policy's settings once: the recipe's ``adapt`` dict (``rollout.spec.adapt.<field>``)
becomes a typed :class:`~areal_npu.speculation.policy.SpecAdaptConfig` (:attr:`SpecConfig.adapt_settings`),
with ``k_max`` = ``num_speculative_tokens``.

What depends on more than speculation is checked by the rollout config that holds this one
(``areal_npu.rollout.config.RolloutConfig.validate``): the device's verify limit
(:data:`ASCEND_MAX_VERIFY_TOKENS`), ``top_k``, and what the installed vLLM offers (``spec.adaptive``
needs runtime k). Speculation sits below rollout and does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from areal_npu.config import ConfigError
from areal_npu.speculation.k_driver import dynamic_table
from areal_npu.speculation.policy import SpecAdaptConfig

#: Methods vLLM accepts that draft from the model's own multi-token-prediction layers.
#: Model-specific names normalise to ``mtp`` inside vLLM (checked against vLLM in the tests).
MTP_ALIASES = (
    "mtp",
    "qwen3_5_mtp",
    "qwen3_next_mtp",
    "deepseek_mtp",
    "mimo_mtp",
    "glm4_moe_mtp",
    "ernie_mtp",
    "longcat_flash_mtp",
    "pangu_ultra_moe_mtp",
)
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3")
SPEC_METHODS = (*MTP_ALIASES, *DRAFT_MODEL_METHODS, "ngram")
#: Ascend's fused attention verifies at most this many tokens per decode step: ``k + 1`` on NPU.
ASCEND_MAX_VERIFY_TOKENS = 16


def resolve_adapt(adapt: dict[str, Any], k_max: int) -> SpecAdaptConfig:
    """``rollout.spec.adapt`` (a dict) as the policy's typed settings, ``k_max`` set from the spec.

    A ``ConfigError`` names ``adapt.<field>`` for an unknown key, ``k_max`` (it is
    ``num_speculative_tokens``) or a value the policy refuses."""
    known = {f.name for f in fields(SpecAdaptConfig)}
    unknown = sorted(set(adapt) - known)
    if unknown:
        raise ConfigError(f"adapt.{unknown[0]}", f"unknown key; valid: {', '.join(sorted(known))}")
    if "k_max" in adapt:
        raise ConfigError("adapt.k_max", "set spec.num_speculative_tokens instead (it is k_max)")
    try:
        return SpecAdaptConfig(**adapt, k_max=k_max).validate()
    except (TypeError, ValueError) as exc:
        name = str(exc).split(":")[0]
        raise ConfigError(f"adapt.{name}" if name in known else "adapt", str(exc)) from None


@dataclass
class SpecConfig:
    """Speculative decoding. ``method=None`` (or ``num_speculative_tokens=0``) switches it off."""

    # null (off) | mtp (the model's own MTP head; vLLM's per-family names qwen3_5_mtp, qwen3_next_mtp,
    # deepseek_mtp, ... are accepted too) | draft_model | eagle | eagle3 (a drafter at draft_model) | ngram
    method: str | None = None
    num_speculative_tokens: int = 0  # k drafts per verify step
    draft_model: str | None = None  # path, for draft_model / eagle / eagle3
    draft_enforce_eager: bool = True  # no graph capture for the drafter
    # Set by the trainer, not in recipes: the directory vLLM loads an MTP drafter from when it is not
    # the policy checkpoint (a dense Qwen3 policy with our head: areal_npu/rollout/dense_mtp.py).
    mtp_draft_dir: str | None = None
    # The MTP head is trained with the policy: weight updates carry mtp.* too. False = frozen head:
    # the drafter is loaded once from the checkpoint and never touched. A recipe resolves it to what
    # is actually synced (false unless the drafter is our MTP head and it trains; areal_npu/recipe.py).
    sync_draft: bool = True
    prompt_lookup_max: int = 4  # ngram only
    prompt_lookup_min: int = 2  # ngram only
    # Adaptive draft length (areal_npu.speculation.policy): num_speculative_tokens becomes the deepest
    # k tried; the trainer changes k between steps (0 = off) from measured acceptance and tokens/s.
    adaptive: bool = False
    adapt: dict[str, Any] = field(default_factory=dict)  # SpecAdaptConfig fields (k_max is set here)
    # At k = 0 vLLM still runs the drafter (to keep its KV cache complete), a rejection-sampler
    # pass and a draft-token fetch; we skip them (areal_npu/compat/vllm/spec_off.py). True keeps
    # vLLM's behaviour.
    off_keeps_drafter_kv: bool = False

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.num_speculative_tokens > 0

    @property
    def is_mtp(self) -> bool:
        return self.method in MTP_ALIASES

    def validate(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(
                f"method {self.method!r} is not a known speculative method; valid: "
                f"{', '.join(SPEC_METHODS)} (or null to switch speculation off)"
            )
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0; got {self.num_speculative_tokens}")
        if self.method is not None and self.num_speculative_tokens == 0:
            raise ValueError(f"num_speculative_tokens must be >= 1 when method is {self.method!r}")
        if self.method in DRAFT_MODEL_METHODS and not self.draft_model:
            raise ValueError(f"draft_model (a path) is required for method {self.method!r}")
        if self.draft_model and self.method not in DRAFT_MODEL_METHODS:
            raise ValueError(
                f"draft_model is only used by {', '.join(DRAFT_MODEL_METHODS)}; method is {self.method!r}"
            )
        if self.mtp_draft_dir and not self.is_mtp:
            raise ValueError(f"mtp_draft_dir is only used by MTP methods; method is {self.method!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be in [1, prompt_lookup_max]")
        default = SpecConfig()
        for key in ("prompt_lookup_max", "prompt_lookup_min"):  # nothing accepted and ignored
            if self.method != "ngram" and getattr(self, key) != getattr(default, key):
                raise ConfigError(key, f"is read by method ngram only; method is {self.method!r}")
        self._adapt_settings = None
        if self.adaptive:
            if not self.enabled:
                raise ConfigError("adaptive", "adaptive speculation needs spec.method and num_speculative_tokens >= 1")
            if not self.is_mtp:
                raise ConfigError(
                    "adaptive",
                    f"method {self.method!r}: adaptive draft length is built and tested for MTP drafters only",
                )
            self._adapt_settings = resolve_adapt(self.adapt, self.num_speculative_tokens)
        elif self.adapt:
            raise ConfigError("adapt", "is only read when adaptive is true")
        if self.off_keeps_drafter_kv and not self.adaptive:
            raise ConfigError("off_keeps_drafter_kv", "is only read when adaptive is true")
        for key in ("num_speculative_tokens", "draft_enforce_eager"):  # speculation off: nothing reads them
            if self.method is None and getattr(self, key) != getattr(default, key):
                raise ConfigError(key, "is read only with a spec.method (speculation is off): set it back to "
                                  f"{getattr(default, key)} too")  # fmt: skip

    @property
    def adapt_settings(self) -> SpecAdaptConfig:
        """The adaptive policy's typed settings, as :meth:`validate` resolved them (adaptive only).

        Not a dataclass field: recipes set ``adapt`` (the dict), and a copy made with
        ``dataclasses.replace`` is validated again before it is used."""
        settings = getattr(self, "_adapt_settings", None)
        if settings is None:
            raise RuntimeError(
                "SpecConfig.adapt_settings: only an adaptive spec (adaptive=true) has them, after validate()"
            )
        return settings

    @property
    def k_at_start(self) -> int:
        """The draft length an engine runs from its start (0: speculation off): adaptive engines
        start at the policy's ``k_init``, others keep ``num_speculative_tokens`` throughout.
        Requires :meth:`validate` for an adaptive spec."""
        if not self.enabled:
            return 0
        return self.adapt_settings.k_init if self.adaptive else self.num_speculative_tokens

    def vllm_dict(self) -> dict[str, Any] | None:
        """The ``speculative_config`` vLLM takes, or None when speculation is off."""
        if not self.enabled:
            return None
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "enforce_eager": self.draft_enforce_eager,
        }
        if self.draft_model:
            out["model"] = self.draft_model
        if self.mtp_draft_dir:
            out["model"] = self.mtp_draft_dir
        if self.method == "ngram":
            out["prompt_lookup_max"] = self.prompt_lookup_max
            out["prompt_lookup_min"] = self.prompt_lookup_min
        if self.adaptive:
            out["num_speculative_tokens_per_batch_size"] = dynamic_table(self.k_at_start)
        return out
