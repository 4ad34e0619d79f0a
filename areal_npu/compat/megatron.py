"""CPU shims for Megatron-Core 0.16.1: what it takes to run its GPTModel on a CPU-only torch build.

Megatron-Core assumes CUDA in a few places that have nothing to do with the maths: it allocates
helper tensors on ``torch.cuda.current_device()``. On a CPU-only build that call raises
("Torch not compiled with CUDA enabled"). Each shim below makes one such upstream function see
``"cpu"`` as the current CUDA device *while it runs*, so the upstream code itself still runs (no
copied Megatron code to drift from upstream). :func:`apply_cpu_patches` applies them all, once;
the engine calls it only when the platform is the CPU (never on NPU, where MindSpeed's adaptor
maps these calls to the NPU, nor on CUDA). ``tests/compat/test_megatron.py`` has one test per
shim that fails once upstream stops needing it.

What is deliberately *not* shimmed, because the Megatron engine never reaches it on the CPU:

- the CUDA RNG tracker (``tensor_parallel.random``): used only by weight initialisation on the
  device (we build with ``use_cpu_initialization`` and load HF weights, no random init), by
  dropout under sequence parallelism and by activation recomputation; the engine refuses
  sequence parallelism (gloo has no reduce-scatter) and recomputation on the CPU;
- ``GlobalMemoryBuffer`` and the packed-sequence refusal of the non-TE ``DotProductAttention``:
  the engine's layer spec uses its own core attention
  (:class:`areal_npu.train.megatron.attention.PackedCoreAttention`, our packed kernel), so
  Megatron's local attention never runs;
- ``MTPLossLoggingHelper``: only ``GPTModel._postprocess`` calls it with labels; the engine
  computes its losses itself (chunked, vocab-parallel).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

__all__ = ["CPU_DEVICE_SHIMS", "apply_cpu_patches", "cuda_device_answers_cpu", "unpatched"]

#: (module, attribute path, why): upstream functions that allocate on ``torch.cuda.current_device()``.
CPU_DEVICE_SHIMS: tuple[tuple[str, str, str], ...] = (
    (
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding.get_emb",
        # Moves ``inv_freq`` to ``torch.cuda.current_device()`` on the first forward whenever it is
        # on the CPU: every RoPE model (Qwen3) fails on a CPU-only build at its first forward.
        "rotary inv_freq is moved to torch.cuda.current_device() on first use",
    ),
)

_ORIGINAL = "_areal_npu_original"
_lock = threading.RLock()
_applied: list[str] = []


@contextlib.contextmanager
def cuda_device_answers_cpu():
    """While active, ``torch.cuda.current_device()`` returns ``"cpu"`` (a valid ``device=`` value);
    only used on CPU-only builds, where the real call can only raise."""
    with _lock:
        original = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            yield
        finally:
            torch.cuda.current_device = original


def _resolve(module_name: str, path: str):
    module = importlib.import_module(module_name)
    owner = module
    parts = path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return module, owner, parts[-1]


def unpatched(module_name: str, path: str):
    """The upstream function behind a shim (itself when not patched)."""
    _, owner, name = _resolve(module_name, path)
    fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return getattr(fn, _ORIGINAL, fn)


def _wrap(fn):
    @functools.wraps(fn)
    def on_cpu(*args, **kwargs):
        with cuda_device_answers_cpu():
            return fn(*args, **kwargs)

    setattr(on_cpu, _ORIGINAL, fn)
    return on_cpu


def _rebind_importers(module_name: str, name: str, old, new) -> None:
    """Modules that did ``from <module> import <name>`` hold their own reference: update those."""
    import sys

    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith("megatron"):
            continue
        if mod.__dict__.get(name) is old:
            setattr(mod, name, new)


def apply_cpu_patches() -> list[str]:
    """Apply every shim in :data:`CPU_DEVICE_SHIMS` (idempotent); returns their paths.

    Refuses to run where CUDA exists: there the upstream code is right as it is."""
    if torch.cuda.is_available():
        raise RuntimeError("the Megatron CPU shims are for CPU-only torch builds; CUDA is available here")
    with _lock:
        for module_name, path, _why in CPU_DEVICE_SHIMS:
            key = f"{module_name}.{path}"
            if key in _applied:
                continue
            _, owner, name = _resolve(module_name, path)
            current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            if hasattr(current, _ORIGINAL):
                _applied.append(key)
                continue
            patched = _wrap(current)
            setattr(owner, name, patched)
            if not isinstance(owner, type):
                _rebind_importers(module_name, name, current, patched)
            _applied.append(key)
        return list(_applied)
