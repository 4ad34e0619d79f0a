"""A short real rollout: tiny Qwen3.5 + MTP served by vLLM with speculative decoding, checked.

Used by ``scripts/smoke_rollout.py`` and by the vLLM tests (``tests/compat/vllm``, ``tests/model``).
The check is independent of vLLM: every sampled token's behaviour log-prob (``raw_logprobs``) is
compared with a transformers forward pass of the same checkpoint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@dataclass
class SmokeResult:
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    seconds: float
    spec: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.completions)


def spec_counters(metrics) -> dict[str, float]:
    """Speculative-decoding counters from ``LLM.get_metrics()`` (acceptance = accepted / drafted)."""
    values: dict[str, float] = {}
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            values[metric.name.split(":")[1]] = float(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values["per_pos"] = [float(v) for v in metric.values]
    drafts = values.get("spec_decode_num_drafts", 0.0)
    draft_tokens = values.get("spec_decode_num_draft_tokens", 0.0)
    accepted = values.get("spec_decode_num_accepted_tokens", 0.0)
    values["accept_rate"] = accepted / draft_tokens if draft_tokens else 0.0
    values["mean_accepted_len"] = 1.0 + accepted / drafts if drafts else 1.0
    return values


def generate(
    model_dir: str,
    prompts: list[list[int]],
    max_tokens: int = 32,
    temperature: float = 0.0,
    num_speculative_tokens: int = 2,
    seed: int = 0,
    drafter: dict | None = None,
) -> SmokeResult:
    """Generate with vLLM (MTP speculation when ``num_speculative_tokens`` > 0; ``drafter``: other
    ``speculative_config`` keys, e.g. ``{"method": "eagle3", "model": path}``); engine shut down after."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    spec = (
        {"method": "mtp", **(drafter or {}), "num_speculative_tokens": num_speculative_tokens}
        if num_speculative_tokens
        else None
    )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=seed,
        speculative_config=spec,
        disable_log_stats=False,
        logprobs_mode="raw_logprobs",  # processed log-probs are wrong under speculation in vLLM 0.32
        # loads areal_npu/compat/vllm/cpu_sampling.py in the worker: without it vllm-cpu samples
        # from garbage temperatures under speculation (lossy at temperature > 0)
        worker_extension_cls="areal_npu.rollout.worker_ext.WeightSyncExtension",
    )
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=seed, ignore_eos=True
        )
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        completions, logprobs = [], []
        for out in outputs:
            ids = list(out.outputs[0].token_ids)
            completions.append(ids)
            logprobs.append(
                [step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, ids, strict=True)]
            )
        counters = spec_counters(llm.get_metrics()) if spec else {}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return SmokeResult(prompts, completions, logprobs, seconds, counters)


def reference_logprobs(
    model_dir: str, prompts: list[list[int]], completions: list[list[int]]
) -> list[torch.Tensor]:
    """log p(completion token | prefix) from a transformers forward pass, one sequence at a time."""
    from areal_npu.testing.reference import load_model, sequence_logprobs

    model = load_model(model_dir)
    with torch.no_grad():
        return [sequence_logprobs(model, p, c).float() for p, c in zip(prompts, completions, strict=True)]
