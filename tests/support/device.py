"""The device the tests compute on (the platform's, as the engines pick it) and how close float32
results must be to their references there.

CPU: the references' sums differ from the code under test only in grouping; each test states its
measured bound. CUDA (and the NPU, unmeasured, assumed alike): cuBLAS picks split-K and tile orders
of its own, the embedding backward adds repeated tokens' rows with atomicAdd in no fixed order,
SDPA reduces differently, and TF32 (off by PyTorch's default) is one flag away; on an H200, rows
whose terms nearly cancel went past the CPU bounds (``embed_tokens``, ``mtp.fc``, a hybrid PPO
step). There ``atol`` is a fraction of the reference's largest magnitude (these gradients range
from 1e-4 to 0.4 between tensors): float32 noise is ~1e-6 of that scale, while a packing or
mapping bug moves gradients by 2e-2 to 2e-1 of it.
"""

from __future__ import annotations

import torch

from areal_npu.platform import current_platform

__all__ = ["float32_grad_tolerance", "on_accelerator", "test_device", "tolerance"]

#: Per kind: rtol, and atol as a fraction of max |reference| (see the module docstring).
ACCELERATOR = {
    "values": dict(rtol=1e-4, scale=1e-5),  # logits, hidden states, log-probs, losses
    "grads": dict(rtol=1e-3, scale=3e-5),
    "weights": dict(rtol=1e-4, scale=1e-4),  # after Adam steps (eps 1e-3): lr / eps amplifies Δg
}


def test_device() -> torch.device:
    """Where the engines put their model (``Platform.current_device``): the tests' inputs go there."""
    return current_platform().current_device()


test_device.__test__ = False  # not a pytest test


def on_accelerator(device: torch.device | None = None) -> bool:
    return (device or test_device()).type != "cpu"


def tolerance(kind: str, cpu: dict, want: torch.Tensor | float | None = None, device=None) -> dict:
    """``assert_close`` keywords: ``cpu`` on the CPU; on an accelerator ``ACCELERATOR[kind]`` with
    ``atol = scale * max |want|`` (``want``: the reference). For ``pytest.approx`` pass a float
    ``want`` and use ``rel`` / ``abs`` of the result."""
    if not on_accelerator(device):
        return dict(cpu)
    entry = ACCELERATOR[kind]
    peak = 0.0 if want is None else float(torch.as_tensor(want).detach().abs().max())
    return dict(rtol=entry["rtol"], atol=entry["scale"] * peak)


def approx(kind: str, cpu_rel: float, want: float, cpu_abs: float | None = None, device=None) -> dict:
    """``pytest.approx`` keywords (``rel``, ``abs``) by the same rule as :func:`tolerance`."""
    cpu = dict(rtol=cpu_rel, atol=cpu_abs)
    tol = tolerance(kind, cpu, want, device)
    return {"rel": tol["rtol"], "abs": tol["atol"]}


def float32_grad_tolerance(device: torch.device) -> dict:
    """How far an engine's float32 gradients may be from a float64 unpacked reference.

    CPU: measured error <= 3e-7 against max |grad| ~ 0.35, so rtol=1e-4, atol=1e-6 is strict and
    stays so. CUDA: the bound of the GPU test (tests/train/test_engine_cuda.py), rtol=1e-3,
    atol=1e-5 (the module docstring says why); dropping one loss token moves these gradients by
    2e-2 to 2e-1."""
    if device.type == "cpu":
        return {"rtol": 1e-4, "atol": 1e-6}
    return {"rtol": 1e-3, "atol": 1e-5}
