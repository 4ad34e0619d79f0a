"""The device seam: one place that knows about Ascend NPU, CUDA and CPU.

Everything device-specific the rest of the code needs -- which device, which collective backend,
which visible-devices variable, memory numbers, bf16 -- comes from :func:`current_platform`.
This is the only module that imports ``torch_npu``, and only inside the NPU branch.

Detection order: ``AREAL_NPU_DEVICE`` (``npu`` | ``cuda`` | ``cpu``) if set, else an NPU if
``torch_npu`` imports and reports a device, else CUDA if available, else the CPU. A ``torch_npu``
that is installed but broken (typically CANN missing: ``libhccl.so`` not found) falls back to the
next device with one clear warning instead of breaking ``import torch``.

A recipe's ``device:`` key goes through the same seam: :func:`select_device` checks it against the
environment variable and the machine, and :func:`use_device` makes it this process's (and its
children's) platform by setting ``AREAL_NPU_DEVICE``.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import areal_npu  # noqa: F401  (switches off torch's backend autoload before torch is imported)

DEVICE_ENV = "AREAL_NPU_DEVICE"
DEVICE_TYPES = ("npu", "cuda", "cpu")


@dataclass(frozen=True)
class DeviceProfile:
    """Static facts about one device family."""

    device_type: str
    dist_backend: str
    visible_devices_env: str | None
    ray_resource: str


PROFILES = {
    "npu": DeviceProfile("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU"),
    "cuda": DeviceProfile("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU"),
    "cpu": DeviceProfile("cpu", "gloo", None, "CPU"),
}


@dataclass(frozen=True)
class Platform:
    """The detected device family plus how it was chosen."""

    profile: DeviceProfile
    reason: str
    warning: str | None = None
    torch_npu_version: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return self.profile.device_type

    @property
    def dist_backend(self) -> str:
        return self.profile.dist_backend

    @property
    def visible_devices_env(self) -> str | None:
        return self.profile.visible_devices_env

    @property
    def ray_resource(self) -> str:
        return self.profile.ray_resource

    def torch_module(self) -> ModuleType | None:
        """``torch.npu`` / ``torch.cuda``; None on the CPU."""
        import torch

        return None if self.device_type == "cpu" else getattr(torch, self.device_type)

    def device(self, index: int | None = None):
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, 0 if index is None else index)

    def current_device(self):
        """The device this process computes on (``set_device``'s choice on accelerators)."""
        module = self.torch_module()
        return self.device() if module is None else self.device(module.current_device())

    def device_count(self) -> int:
        module = self.torch_module()
        return 1 if module is None else int(module.device_count())

    def set_device(self, index: int) -> None:
        module = self.torch_module()
        if module is not None:
            module.set_device(index)

    def synchronize(self) -> None:
        module = self.torch_module()
        if module is not None:
            module.synchronize()

    def supports_bf16(self) -> bool:
        if self.device_type == "npu":
            return True  # Ascend 910B/910C compute bf16 natively
        if self.device_type == "cuda":
            import torch

            return bool(torch.cuda.is_bf16_supported())
        return True  # CPU kernels exist for bf16; fp32 is still the default there for exactness

    def memory_stats(self) -> dict[str, float]:
        """Allocated / reserved / peak bytes on the device, or process RSS on the CPU (in GiB)."""
        gib = float(1 << 30)
        module = self.torch_module()
        if module is None:
            import psutil

            rss = psutil.Process().memory_info().rss
            return {"mem/rss_gib": rss / gib}
        return {
            "mem/allocated_gib": module.memory_allocated() / gib,
            "mem/reserved_gib": module.memory_reserved() / gib,
            "mem/peak_allocated_gib": module.max_memory_allocated() / gib,
        }


def _npu_probe(import_module: Callable[[str], ModuleType]) -> tuple[bool, str | None, str | None]:
    """(available, torch_npu version, warning). Never raises."""
    try:
        torch_npu = import_module("torch_npu")
    except ModuleNotFoundError:
        return False, None, None
    except Exception as exc:  # noqa: BLE001 - CANN missing shows up as OSError/ImportError/RuntimeError
        return (
            False,
            None,
            (
                f"torch_npu is installed but failed to import ({type(exc).__name__}: {exc}); "
                "is CANN installed and set_env.sh sourced? Falling back to the next device."
            ),
        )
    version = getattr(torch_npu, "__version__", None)
    try:
        available = bool(torch_npu.npu.is_available())
    except Exception as exc:  # noqa: BLE001
        return False, version, f"torch_npu imported but torch_npu.npu.is_available() failed: {exc}"
    return available, version, None


def detect_platform(
    env: dict[str, str] | None = None,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    cuda_available: Callable[[], bool] | None = None,
) -> Platform:
    """Detect the device family. Arguments exist so tests can simulate machines."""
    env = os.environ if env is None else env
    if cuda_available is None:

        def cuda_available() -> bool:
            import torch

            return torch.cuda.is_available()

    forced = env.get(DEVICE_ENV, "").strip().lower()
    if forced and forced not in DEVICE_TYPES:
        raise ValueError(f"{DEVICE_ENV}={forced!r} is not one of {', '.join(DEVICE_TYPES)}")
    if forced == "cpu":
        return Platform(PROFILES["cpu"], reason=f"{DEVICE_ENV}=cpu")
    if forced == "cuda":
        return Platform(PROFILES["cuda"], reason=f"{DEVICE_ENV}=cuda")

    npu_ok, npu_version, warning = _npu_probe(import_module)
    if npu_ok:
        return Platform(PROFILES["npu"], reason="torch_npu reports an NPU", torch_npu_version=npu_version)
    if forced == "npu":
        raise RuntimeError(f"{DEVICE_ENV}=npu but no usable NPU: {warning or 'torch_npu not installed'}")
    if cuda_available():
        return Platform(
            PROFILES["cuda"],
            reason="torch.cuda.is_available()",
            warning=warning,
            torch_npu_version=npu_version,
        )
    return Platform(
        PROFILES["cpu"], reason="no accelerator found", warning=warning, torch_npu_version=npu_version
    )


def select_device(
    requested: str,
    env: dict[str, str] | None = None,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    cuda_available: Callable[[], bool] | None = None,
) -> Platform:
    """The platform a run configured with ``device: requested`` computes on.

    ``auto`` is :func:`detect_platform`. An explicit family must agree with ``AREAL_NPU_DEVICE``
    when that is set (two settings that disagree are refused, not ranked) and must exist here: an
    NPU that ``torch_npu`` reports, a CUDA device ``torch.cuda.is_available()`` sees, or the CPU.
    Raises ``ValueError`` saying which of those failed.
    """
    env = os.environ if env is None else env
    if requested == "auto":
        return detect_platform(env, import_module, cuda_available)
    if requested not in DEVICE_TYPES:
        raise ValueError(f"must be one of auto, {', '.join(DEVICE_TYPES)}; got {requested!r}")
    forced = env.get(DEVICE_ENV, "").strip().lower()
    if forced and forced != requested:
        raise ValueError(
            f"{requested!r} disagrees with {DEVICE_ENV}={forced} in the environment; "
            f"unset one of them or make them equal"
        )
    if requested == "cpu":
        return Platform(PROFILES["cpu"], reason="device: cpu")
    if requested == "npu":
        npu_ok, npu_version, warning = _npu_probe(import_module)
        if not npu_ok:
            raise ValueError(
                f"'npu' but this machine has no usable NPU ({warning or 'torch_npu is not installed'})"
            )
        return Platform(PROFILES["npu"], reason="device: npu", torch_npu_version=npu_version)
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available
    if not cuda_available():
        raise ValueError("'cuda' but torch.cuda.is_available() is false on this machine")
    return Platform(PROFILES["cuda"], reason="device: cuda")


def use_device(requested: str) -> Platform:
    """Make ``device: requested`` this process's platform (and, through ``AREAL_NPU_DEVICE``, the
    platform of every process it starts: trainer ranks, rollout engines)."""
    chosen = select_device(requested)
    os.environ[DEVICE_ENV] = chosen.device_type
    current_platform.cache_clear()
    return current_platform()


@functools.lru_cache(maxsize=1)
def current_platform() -> Platform:
    """The platform of this process, detected once. Emits the fallback warning once."""
    platform = detect_platform()
    if platform.warning:
        warnings.warn(platform.warning, RuntimeWarning, stacklevel=2)
    return platform


def import_torch_npu() -> ModuleType:
    """``torch_npu`` for NPU-only code paths (kernels). Raises if this process is not on an NPU."""
    if current_platform().device_type != "npu":
        raise RuntimeError("torch_npu requested but this process is not running on an Ascend NPU")
    return importlib.import_module("torch_npu")
