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

import contextlib
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
    Raises ``ValueError`` saying which of those failed. Inside :func:`described_device` the
    described kind answers instead of this machine.
    """
    env = os.environ if env is None else env
    if _DESCRIBED and requested in ("auto", _DESCRIBED[-1]):  # described_device(): not this machine
        return Platform(PROFILES[_DESCRIBED[-1]], reason=f"described: {_DESCRIBED[-1]}")
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


_DESCRIBED: list[str] = []


@contextlib.contextmanager
def described_device(kind: str):
    """Within the block, :func:`select_device` resolves ``auto`` and ``kind`` itself to ``kind``
    without probing this machine: a recipe validated for machines described on the command line
    (``train --dry-run --device-kind``). Another explicit device still goes through the machine.
    Nothing may compute inside: no device is set up and :func:`current_platform` is unchanged."""
    if kind not in DEVICE_TYPES:
        raise ValueError(f"must be one of {', '.join(DEVICE_TYPES)}; got {kind!r}")
    _DESCRIBED.append(kind)
    try:
        yield
    finally:
        _DESCRIBED.pop()


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


def hccl_process_group_class() -> type:
    """torch_npu's ``ProcessGroupHCCL`` (HCCL registered by importing torch_npu); NPU only."""
    import_torch_npu()
    return importlib.import_module("torch_npu._C._distributed_c10d").ProcessGroupHCCL


# ---- visible devices of the processes a run starts (the placement planner's seam) ----

#: A CPU process's core set, as a taskset-style list (``0-3,8``). The process applies it to itself
#: at start (``os.sched_setaffinity``), so everything it starts inherits it.
CPU_AFFINITY_ENV = "AREAL_CPU_AFFINITY"


def format_id_list(ids) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (taskset's list syntax); order kept, runs collapsed."""
    ids = [int(i) for i in ids]
    parts: list[str] = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def parse_id_list(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``; ValueError on anything else (e.g. CUDA device UUIDs)."""
    ids: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and (not high.isdigit() or int(high) < int(low))):
            raise ValueError(f"{text!r} is not a list of device indices (like 0-3,8)")
        ids.extend(range(int(low), int(high or low) + 1))
    return ids


def visible_devices_env(kind: str, ids) -> dict[str, str]:
    """The environment that gives a process exactly devices ``ids`` (physical ids, in the order
    its logical devices should have): ``ASCEND_RT_VISIBLE_DEVICES`` on NPU, ``CUDA_VISIBLE_DEVICES``
    on CUDA; on the CPU the core set (:data:`CPU_AFFINITY_ENV`) and as many OpenMP threads."""
    ids = [int(i) for i in ids]
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f"device ids must be distinct and >= 0, at least one; got {ids}")
    profile = PROFILES[kind]
    if profile.visible_devices_env is not None:
        return {profile.visible_devices_env: ",".join(map(str, ids))}
    return {CPU_AFFINITY_ENV: format_id_list(ids), "OMP_NUM_THREADS": str(len(ids))}


def visible_device_ids(kind: str, env: dict[str, str] | None = None, count: int | None = None) -> list[int]:
    """The physical ids this process may hand to the processes it starts: on the CPU the cores of
    its affinity; on NPU / CUDA the ids in the visible-devices variable when it is set (a child's
    variable names physical devices, not the parent's logical ones), else ``0 .. count - 1``
    (``count``: the platform's device count)."""
    env = os.environ if env is None else env
    if kind == "cpu":
        return sorted(os.sched_getaffinity(0))
    variable = PROFILES[kind].visible_devices_env
    if env.get(variable, "").strip():
        try:
            return parse_id_list(env[variable])
        except ValueError as exc:
            raise ValueError(f"{variable}: {exc}") from None
    if count is None:
        count = current_platform().device_count()
    return list(range(count))
