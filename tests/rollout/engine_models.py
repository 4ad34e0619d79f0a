"""The checkpoint the engine tests serve, per vLLM version, with its transformers reference.

vLLM 0.32 (the CPU default) serves the text-layout tiny model (``Qwen3_5ForCausalLM``). vLLM 0.23
-- the images' version -- serves Qwen3.5 only as ``Qwen3_5ForConditionalGeneration``, the
published layout (``compat/vllm/features.py`` ``qwen3_5_text_class``), so on 0.23 the tests
serve the published tiny model (``areal_npu.model.tiny``, ``layout="published"``). Its layers are
all full attention: 0.23's CPU Gated DeltaNet kernel refuses speculative decoding outright
("speculative decode not supported in CPU GDN attention"), so a hybrid cannot speculate there,
while the VL class with full attention only runs on 0.23 (0.32 refuses it: "no mamba layers"),
in float32 like the text model. Both get the near-oracle drafter construction of
``areal_npu.testing.synthetic``, on their own names; both are checked to 1e-4 in log-prob and
token for token against transformers (``ServedModel.load_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from areal_npu.compat.vllm import features as vllm_version
from areal_npu.testing import reference, synthetic


@dataclass
class ServedModel:
    path: Path
    layout: str  # "text" | "published"
    dtype: str  # what the engine serves in
    logprob_tol: float  # |vLLM raw log-prob - reference| per token
    policy_names: int  # tensors a full policy update sends (checkpoint names, mtp.* excluded)
    draft_names: int  # mtp.* tensors

    def engine_kwargs(self) -> dict:
        """The engine arguments for this checkpoint. The published (0.23) tiny model is served without
        prefix caching: with it, vLLM puts every ``Qwen3_5ForConditionalGeneration`` -- a hybrid class
        -- in mamba cache mode "align" (``model_executor/models/config.py``, ``MambaModelConfig``), and
        0.23's model runner then asserts on the first request that the model has mamba layers, which
        this all-full-attention test model has not ("no mamba layers in the model",
        ``v1/worker/mamba_utils.py`` ``get_mamba_groups``). A real Qwen3.5 has its Gated DeltaNet
        layers; prefix caching and its reset on weight updates are tested on 0.32's text model."""
        if self.layout == "text":
            return {"model": str(self.path), "dtype": self.dtype, "extra_engine_args": {}}
        return {
            "model": str(self.path),
            "dtype": self.dtype,
            "extra_engine_args": {"limit_mm_per_prompt": {"image": 0, "video": 0}},
            "enable_prefix_caching": False,
        }

    def load_reference(self, path: Path | None = None):
        path = path or self.path
        if self.layout == "text":
            return reference.load_model(path)
        from transformers import Qwen3_5ForConditionalGeneration

        # the weights as vLLM holds them (rounded to bf16 when it serves in bf16), arithmetic in float32
        model = Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, self.dtype))
        return model.float().eval()

    def flip_final_norm(self, tensors: dict[str, torch.Tensor], seed: int, sync_draft: bool = True):
        """A new policy (random signs on the final norm), the drafter's norm flipped along when
        ``sync_draft`` -- :func:`synthetic.flip_final_norm`, which reads either layout's names."""
        return synthetic.flip_final_norm(tensors, seed, sync_draft)


def serves_text_layout() -> bool:
    """vLLM 0.32 serves ``Qwen3_5ForCausalLM``; 0.23 refuses it ("not supported for now")."""
    return vllm_version.has("qwen3_5_text_class")


def save_engine_model(out_dir: Path) -> ServedModel:
    out_dir = Path(out_dir)
    from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model

    if serves_text_layout():
        path = synthetic.save_aligned_model(out_dir, TinyModelConfig(**TEXT_FULL_ATTENTION))
        layout, dtype, tol = "text", "float32", 1e-4
    else:
        # all full attention, float32 (see above): not the default hybrid shapes
        full = dict(TEXT_FULL_ATTENTION, layout="published")
        base = save_tiny_model(out_dir / "_base", TinyModelConfig(**full))
        tensors = synthetic.aligned_tensors(synthetic.load_tensors(base), residual_scale=0.1, logit_scale=40.0)
        path = synthetic.save_tensors(out_dir / "model", base, tensors)
        layout, dtype, tol = "published", "float32", 1e-4
    names = synthetic.load_tensors(path)
    draft = sum(1 for n in names if n.startswith("mtp."))
    return ServedModel(path, layout, dtype, tol, len(names) - draft, draft)
