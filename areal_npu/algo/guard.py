"""Non-finite guard: a training step is never applied with NaN/Inf in its inputs.

Call :func:`nonfinite_guard` on the step's rewards, advantages and log-probs before the loss. In
``raise`` mode any non-finite value raises :class:`NonFiniteError` naming the step, the tensor and
where the values are. In ``drop`` mode it returns a per-sample keep mask instead (the caller
removes those samples from the step); if nothing would be left it raises all the same.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from areal_npu.algo.segments import resolve_segment_ids, segment_sum


class NonFiniteError(FloatingPointError):
    """Non-finite values in a step's inputs; ``.step`` and ``.tensor`` say where."""

    def __init__(self, step: int | str, tensor: str, message: str):
        super().__init__(message)
        self.step = step
        self.tensor = tensor


def _describe(step: int | str, name: str, x: Tensor, bad: Tensor) -> str:
    n_nan = int(torch.isnan(x[bad]).sum()) if x.is_floating_point() else 0
    n_bad = int(bad.sum())
    idx = bad.nonzero()[:5].tolist()
    return (
        f"step {step}: tensor '{name}' has {n_bad} non-finite value(s) "
        f"({n_nan} NaN, {n_bad - n_nan} Inf) of {bad.numel()}, shape {tuple(x.shape)}, first at {idx}"
    )


def nonfinite_guard(
    step: int | str,
    *,
    per_sample: Mapping[str, Tensor] | None = None,
    per_token: Mapping[str, Tensor] | None = None,
    token_mask: Tensor | None = None,
    segment_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    num_samples: int | None = None,
    mode: str = "raise",
) -> Tensor | None:
    """Check tensors for NaN/Inf.

    per_sample: tensors with the sample axis first ([B] rewards, sequence advantages, …).
    per_token:  tensors of the token shape; only positions where ``token_mask`` is true are checked
                (prompt and padding positions may legitimately hold anything).
    mode:       "raise" → raise NonFiniteError for the first offending tensor, return None.
                "drop"  → return a bool keep mask [B] (False for samples with any non-finite value;
                token tensors are mapped to samples via ``segment_ids`` / ``cu_seqlens``); raise if
                every sample would be dropped.
    """
    if mode not in ("raise", "drop"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'drop', got {mode!r}")
    per_sample = dict(per_sample or {})
    per_token = dict(per_token or {})
    bad_masks: dict[str, Tensor] = {}
    for name, x in per_sample.items():
        bad_masks[f"sample:{name}"] = ~torch.isfinite(x.detach())
    for name, x in per_token.items():
        bad = ~torch.isfinite(x.detach())
        if token_mask is not None:
            bad = bad & token_mask.to(torch.bool)
        bad_masks[f"token:{name}"] = bad

    if mode == "raise":
        for key, bad in bad_masks.items():
            if bool(bad.any()):
                kind, name = key.split(":", 1)
                x = per_sample[name] if kind == "sample" else per_token[name]
                raise NonFiniteError(step, name, _describe(step, name, x, bad))
        return None

    if num_samples is None:
        if per_sample:
            num_samples = next(iter(per_sample.values())).shape[0]
        elif cu_seqlens is not None:
            num_samples = cu_seqlens.numel() - 1
        else:
            raise ValueError("drop mode needs num_samples, a per_sample tensor or cu_seqlens")
    device = next(iter(bad_masks.values())).device if bad_masks else torch.device("cpu")
    bad_samples = torch.zeros(num_samples, dtype=torch.bool, device=device)
    culprits: list[str] = []
    for key, bad in bad_masks.items():
        kind, name = key.split(":", 1)
        if kind == "sample":
            if bad.shape[0] != num_samples:
                raise ValueError(
                    f"per_sample tensor '{name}' has {bad.shape[0]} rows, expected {num_samples}"
                )
            row_bad = bad.reshape(num_samples, -1).any(dim=1)
        else:
            seg, _ = resolve_segment_ids(bad, segment_ids, cu_seqlens)
            row_bad = segment_sum(bad.to(torch.long), seg, num_samples) > 0
        if bool(row_bad.any()):
            culprits.append(name)
        bad_samples |= row_bad
    if bool(bad_samples.all()) and num_samples > 0:
        raise NonFiniteError(
            step, ",".join(culprits), f"step {step}: every sample has non-finite values in {culprits}"
        )
    return ~bad_samples
