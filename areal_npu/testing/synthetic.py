"""A tiny Qwen3.5 + MTP checkpoint whose MTP head is a near-oracle drafter (tests, benchmarks).

Stand-in for a trained MTP head while none is available. Construction, on top of
``save_tiny_model``: every decoder layer's residual contributions (``o_proj``, ``down_proj``) are
scaled by ``residual_scale`` so the backbone is close to a bigram model,
``h_t ~ norm(E[x_t])``, while attention still matters (log-prob checks stay meaningful); the output
head is scaled by ``logit_scale`` so next-token distributions concentrate on a few tokens. The MTP
head is set to reproduce that bigram one step ahead: ``fc = [I | 0]`` keeps only the normalised
embedding of ``x_{t+1}``, its decoder layer adds nothing (zero ``o_proj``/``down_proj``), and
``mtp.norm`` equals the backbone's final norm -- so the drafter proposes
``softmax(W norm(E[x_{t+1}]))``, the target's distribution up to the small residual terms. Drafts
are mostly, not always, accepted: rejection and residual resampling both get exercised.

``flip_final_norm(tensors, seed)`` makes a "new policy": a random sign per hidden dimension on the
final norm's scale (zero-centred weights: ``1 + w = ±1``). With ``mtp.norm`` flipped the same way
the drafter follows the policy; left alone, its proposals become unrelated to the policy's and
acceptance collapses -- which is why the drafter has to be synced with the policy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from areal_npu.model.tiny import TinyModelConfig, save_tiny_model


def _text_prefix(tensors: dict[str, torch.Tensor]) -> str:
    """The language model's name prefix: ``model.`` (text layout) or ``model.language_model.`` (published)."""
    return "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."


def aligned_tensors(
    base: dict[str, torch.Tensor], residual_scale: float = 0.1, logit_scale: float = 40.0
) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in base.items()}
    text = _text_prefix(out)
    residual = ("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")
    for name in out:
        if name.startswith(text + "layers.") and name.endswith(residual):
            out[name] *= residual_scale
        if name.startswith("mtp.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name].zero_()
    out["lm_head.weight"] *= logit_scale
    hidden = out["mtp.fc.weight"].shape[0]
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    out["mtp.fc.weight"] = fc
    out["mtp.norm.weight"] = out[text + "norm.weight"].clone()
    return out


def flip_final_norm(
    tensors: dict[str, torch.Tensor], seed: int, sync_draft: bool = True
) -> dict[str, torch.Tensor]:
    """A new policy: random signs on the final norm's scale; the drafter's norm too when ``sync_draft``."""
    out = {k: v.clone() for k, v in tensors.items()}
    text = _text_prefix(out)
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(out[text + "norm.weight"].shape, generator=g) < 0.5, -1.0, 1.0)
    out[text + "norm.weight"] = signs - 1.0  # zero-centred: scale = 1 + w = sign
    if sync_draft:
        out["mtp.norm.weight"] = out[text + "norm.weight"].clone()
    return out


def save_tensors(out_dir: str | Path, template_dir: str | Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory with ``template_dir``'s config/tokenizer and these tensors."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(template_dir).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def load_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def save_aligned_model(
    out_dir: str | Path,
    cfg: TinyModelConfig | None = None,
    residual_scale: float = 0.1,
    logit_scale: float = 40.0,
) -> Path:
    out = Path(out_dir)
    base_dir = save_tiny_model(out / "_base", cfg)
    tensors = aligned_tensors(load_tensors(base_dir), residual_scale, logit_scale)
    return save_tensors(out / "model", base_dir, tensors)
