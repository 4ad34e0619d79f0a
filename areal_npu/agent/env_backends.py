"""Environment backends: where an episode's commands run (``workflow.shell.env.backend``).

Every backend runs one shell command at a time on a task's environment image, with the episode's
repository copy (a host directory) mounted writable at the task's work dir, under the same
:class:`~areal_npu.agent.jail.JailLimits` (CPU, memory, process count, disk, wall time), with no
network, and leaves nothing behind: each command is its own jail or container, files persist in
the repository copy only.

- ``bwrap``: rootless bubblewrap (:mod:`areal_npu.agent.jail`) on the task's root filesystem as
  ``/`` (read-only), unpacked from an OCI layout or archive, or a prepared directory
  (:mod:`areal_npu.agent.rootfs`); with no image, the host's ``/usr`` and interpreter (the
  embedded tasks);
- ``podman`` / ``docker`` / ``apptainer``: the instance's image as it ships (the field's default),
  one ``run --rm`` (``exec``) per command; found on ``PATH``, their command lines are built here
  (:meth:`ContainerBackend.argv`) and tested against recording fakes where no engine runs;
- ``process``: no isolation at all; only when chosen by name (``backend: process`` or
  ``fallback: process``); commands see the repository at its host path.

``auto`` takes the first of bwrap, podman, docker, apptainer that can start here. It never
degrades silently: when nothing isolated starts, :func:`resolve` raises a ConfigError naming every
reason, unless ``env.fallback`` names the weaker backend to use. The backend in use is what
:func:`resolve` returns; the run records it.

``check_image(image)`` says, without pulling or unpacking anything, why a task's image cannot be
used by a backend (None: it can); :func:`unreachable_images` runs it once per distinct image, so
``areal-npu train --check`` refuses a task set whose images are not on this node.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from areal_npu.agent import rootfs
from areal_npu.agent.fs import DiskWatch
from areal_npu.agent.jail import JailLimits, JailResult, Mount, OutputCapture, backend
from areal_npu.config import ConfigError

CONTAINER_TOOLS = ("podman", "docker", "apptainer")
AUTO_ORDER = ("bwrap", *CONTAINER_TOOLS)
NAMES = ("auto", *AUTO_ORDER, "process")
KEY = "workflow.shell.env"


@dataclass
class EnvConfig:
    """where episodes run: the environment backend and what may stand in for it"""

    backend: str = "auto"  # auto | bwrap | podman | docker | apptainer | process (no isolation)
    # the backend used when the chosen one cannot start here: "" (refuse) or one of the names above;
    # the only way a run ends up weaker than asked for
    fallback: str = ""
    warm: int = 2  # environments prepared ahead per task (a copy of its repository), 0: prepare on reset
    # run bwrap episodes where no control group can be made: memory and CPU time are then limited per
    # process only, the process count by RLIMIT_NPROC in the jail's user namespace (not at all when the
    # trainer runs as root: the kernel does not check it for root); false: --check refuses with the reason
    allow_no_cgroup: bool = False

    def validate(self) -> None:
        if self.backend not in NAMES:
            raise ConfigError("backend", f"must be one of {', '.join(NAMES)}; got {self.backend!r}")
        if self.fallback not in ("", *NAMES[1:]):
            raise ConfigError("fallback", f"must be empty or one of {', '.join(NAMES[1:])}; "
                              f"got {self.fallback!r}")  # fmt: skip
        if self.warm < 0:
            raise ConfigError("warm", f"must be >= 0; got {self.warm}")


class EnvBackend(Protocol):
    name: str
    isolated: bool

    def available(self) -> tuple[bool, str]: ...

    def run(self, command: str, repo: Path, limits: JailLimits, image: str, workdir: str,
            env: dict[str, str]) -> JailResult: ...  # fmt: skip

    def export_repo(self, image: str, workdir: str, dest: Path) -> None: ...

    def check_image(self, image: str) -> str | None: ...  # why ``image`` cannot be used (None: it can)


class BwrapBackend:
    """The jail on the task's root filesystem (or on the host's interpreter when ``image`` is empty)."""

    name, isolated = "bwrap", True

    def available(self) -> tuple[bool, str]:
        return backend("bwrap").available()

    def run(self, command, repo, limits, image, workdir, env):
        try:
            root = rootfs.unpack(image) if image else None
        except (OSError, ValueError, RuntimeError) as exc:
            return JailResult(None, None, error=f"the image {image!r} cannot be unpacked: {exc}")
        return backend("bwrap").run(["/bin/sh", "-c", command], [Mount(repo, workdir, writable=True)], limits,
                                    cwd=workdir, env=env, root=root)  # fmt: skip

    def export_repo(self, image, workdir, dest):
        src = rootfs.unpack(image) / workdir.lstrip("/")
        if not src.is_dir():
            raise ValueError(f"the image {image!r} has no repository at {workdir}")
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)

    def check_image(self, image):
        """An OCI layout, an OCI / docker-save archive or a root filesystem directory on this node, and
        the tools to unpack it (:func:`areal_npu.agent.rootfs.check`; nothing is unpacked)."""
        return rootfs.check(image) if image else None  # no image: the host's interpreter


def _supervise(argv: list[str], limits: JailLimits, writable: Path, on_kill, **popen) -> JailResult:
    """Run ``argv`` to its end under the wall clock and the disk quota of ``writable``; output captured
    (head and tail). ``on_kill()`` ends what the process started elsewhere (a container)."""
    disk = DiskWatch([writable], limits.disk_bytes, poll_s=0.2)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, **popen)  # fmt: skip
    except OSError as exc:
        return JailResult(None, None, error=f"{type(exc).__name__}: {exc}")
    reader = OutputCapture(proc.stdout, limits.output_bytes)
    deadline, timed_out, disk_hit = time.monotonic() + limits.wall_seconds, False, False
    while True:
        try:
            proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            timed_out = True
            break
        if disk.exceeded():
            disk_hit = True
            break
    if proc.poll() is None:
        on_kill()
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    output, total = reader.result()
    code = proc.returncode
    exit_code, sig = (None, -code) if code < 0 else (code, None)
    return JailResult(exit_code, sig, timed_out=timed_out, disk_exceeded=disk_hit or disk.exceeded(final=True),
                      output=output, output_total=total, layers=("wall_clock", disk.layer))  # fmt: skip


class ContainerBackend:
    """One container per command from the task's image: ``podman``/``docker run --rm`` or
    ``apptainer exec``, no network, the limits as the engine's flags, the repository bind-mounted."""

    isolated = True

    def __init__(self, tool: str, binary: str | None = None):
        self.name, self.binary = tool, binary or shutil.which(tool)

    def available(self) -> tuple[bool, str]:
        if self.binary is None:
            return False, f"{self.name} is not installed (not on PATH)"
        probe = [self.binary, "version"] if self.name == "apptainer" else [self.binary, "info"]
        try:
            res = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"{self.name} does not answer: {exc}"
        if res.returncode != 0:
            why = (res.stderr or res.stdout).strip().splitlines()
            return (
                False,
                f"{self.name} cannot run containers here: {why[-1] if why else f'exit {res.returncode}'}",
            )
        return True, ""

    def argv(self, command: str, repo: Path, limits: JailLimits, image: str, workdir: str, env: dict[str, str],
             name: str) -> list[str]:  # fmt: skip
        cpus = f"{limits.cpu_cores:g}"
        if self.name == "apptainer":
            args = [self.binary, "exec", "--containall", "--cleanenv", "--no-home", "--net", "--network", "none",
                    "--memory", str(int(limits.memory_bytes)), "--cpus", cpus,
                    "--pids-limit", str(int(limits.max_processes)),
                    "--bind", f"{repo}:{workdir}", "--pwd", workdir]  # fmt: skip
            for key, value in env.items():
                args += ["--env", f"{key}={value}"]
            return [*args, image, "/bin/sh", "-c", command]
        args = [self.binary, "run", "--rm", "--name", name, "--network", "none", "--read-only",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--cpus", cpus, "--memory", str(int(limits.memory_bytes)),
                "--memory-swap", str(int(limits.memory_bytes)), "--pids-limit", str(int(limits.max_processes)),
                "--ulimit", f"nofile={int(limits.max_open_files)}", "--ulimit", f"fsize={int(limits.file_bytes)}",
                "--ulimit", "core=0", "--tmpfs", f"/tmp:rw,size={int(limits.tmp_bytes)}",
                "--volume", f"{repo}:{workdir}:rw", "--workdir", workdir]  # fmt: skip
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        return [*args, image, "/bin/sh", "-c", command]

    def run(self, command, repo, limits, image, workdir, env):
        if not image:
            return JailResult(None, None, error=f"the {self.name} backend needs the task's image")
        name = f"areal-{uuid.uuid4().hex[:12]}"

        def kill() -> None:
            if self.name != "apptainer":  # apptainer's processes are the child's own: killpg ends them
                subprocess.run([self.binary, "rm", "-f", name], capture_output=True, timeout=60)

        res = _supervise(self.argv(command, repo, limits, image, workdir, env, name), limits, repo, kill)
        res.layers = (self.name, "netns", *res.layers)
        return res

    def export_repo(self, image, workdir, dest):
        dest.mkdir(parents=True, exist_ok=True)
        if self.name == "apptainer":
            argv = [self.binary, "exec", "--containall", "--bind", f"{dest}:/areal-export", image,
                    "/bin/sh", "-c", f"cp -a {workdir}/. /areal-export/"]  # fmt: skip
            subprocess.run(argv, check=True, capture_output=True, timeout=600)
            return
        name = f"areal-export-{uuid.uuid4().hex[:12]}"
        subprocess.run(
            [self.binary, "create", "--name", name, image], check=True, capture_output=True, timeout=600
        )
        try:
            subprocess.run([self.binary, "cp", f"{name}:{workdir}/.", str(dest)], check=True, capture_output=True,
                           timeout=600)  # fmt: skip
        finally:
            subprocess.run([self.binary, "rm", "-f", name], capture_output=True, timeout=60)

    def check_image(self, image):
        """apptainer: a .sif file or a sandbox directory on this node; podman / docker: ``image
        inspect`` finds the image in the local store. Nothing is pulled."""
        if not image:
            return f"the {self.name} backend needs the task's image"
        if self.name == "apptainer":
            path = Path(image)
            if path.is_dir() or (path.suffix == ".sif" and path.is_file()):
                return None
            return ("not a .sif file or a sandbox directory on this node (nothing is pulled: build one "
                    "first with `apptainer build NAME.sif docker://REF` and name it as the task's image)")  # fmt: skip
        if self.binary is None:
            return f"{self.name} is not installed (not on PATH)"
        try:
            res = subprocess.run([self.binary, "image", "inspect", image], capture_output=True, text=True,
                                 timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{self.name} image inspect failed: {exc}"
        if res.returncode == 0:
            return None
        why = (res.stderr or res.stdout).strip().splitlines()
        return (f"not in {self.name}'s local image store ({why[-1] if why else f'exit {res.returncode}'}); "
                f"{self.name} pull it on every node first")  # fmt: skip


class ProcessBackend:
    """No isolation: the command runs as this user in the repository's host directory, with rlimits
    and the wall clock only. Chosen by name, never by ``auto``."""

    name, isolated = "process", False

    def available(self) -> tuple[bool, str]:
        return True, ""

    def run(self, command, repo, limits, image, workdir, env):
        def set_limits() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (int(limits.memory_bytes),) * 2)
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits.file_bytes),) * 2)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), "LC_ALL": "C.UTF-8"}
        res = _supervise(["/bin/sh", "-c", command], limits, repo, lambda: None, cwd=repo, env={**base, **env},
                         preexec_fn=set_limits)  # fmt: skip
        res.layers = ("process", "rlimits_per_process", *res.layers)
        return res

    def export_repo(self, image, workdir, dest):
        BwrapBackend().export_repo(image, workdir, dest)  # the image's tree is read the same way

    def check_image(self, image):
        return None  # commands run on the host: no image is used


@functools.cache
def get(name: str) -> EnvBackend:
    if name == "bwrap":
        return BwrapBackend()
    if name in CONTAINER_TOOLS:
        return ContainerBackend(name)
    if name == "process":
        return ProcessBackend()
    raise ConfigError("env.backend", f"must be one of {', '.join(NAMES)}; got {name!r}")


def resolve(cfg: EnvConfig, key: str = KEY, fallback_key: str = "", backend_key: str = "") -> EnvBackend:
    """The backend episodes use here. ``auto``: the first isolated one that starts; a chosen one that
    cannot start is refused -- with every reason -- unless ``fallback`` names the stand-in. ``key``:
    where ``cfg`` sits in the config being checked (errors name ``key.backend``); ``fallback_key``:
    what the refusal tells the user to set (default ``key.fallback``); ``backend_key``: the name the
    refusal is filed under (default ``key.backend``; a command line passes its option names)."""
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"{key}.{exc.key}", str(exc)[len(exc.key) + 2 :]) from None
    names = AUTO_ORDER if cfg.backend == "auto" else (cfg.backend,)
    reasons = []
    for name in names:
        ok, why = get(name).available()
        if ok:
            return get(name)
        reasons.append(f"{name}: {why}")
    if cfg.fallback:
        ok, why = get(cfg.fallback).available()
        if ok:
            return get(cfg.fallback)
        reasons.append(f"fallback {cfg.fallback}: {why}")
    raise ConfigError(backend_key or f"{key}.backend", f"{cfg.backend!r} cannot start here ({'; '.join(reasons)}); set "
                      f"{fallback_key or key + '.fallback'} to a weaker backend (e.g. process, no isolation) "
                      "to allow one")  # fmt: skip


def check_cgroup(cfg: EnvConfig, backend: EnvBackend, key: str = KEY) -> None:
    """Refuse (a ConfigError at ``key.allow_no_cgroup``) a bwrap backend that cannot make a control
    group here, unless ``cfg.allow_no_cgroup``. Container engines limit through their own groups; the
    process backend is unisolated by name. The run records per episode which limits held
    (:data:`areal_npu.names.LIMIT_STATS`)."""
    if backend.name != "bwrap" or cfg.allow_no_cgroup:
        return
    from areal_npu.agent import cgroups
    from areal_npu.agent.process_cap import nproc_rlimit_holds

    ok, why = cgroups.probe()
    if not ok:
        count = ("by RLIMIT_NPROC in the jail's user namespace" if nproc_rlimit_holds() else
                 "not at all (the kernel does not check RLIMIT_NPROC for root)")  # fmt: skip
        raise ConfigError(f"{key}.allow_no_cgroup", f"no control group can be made here ({why}): memory and CPU "
                          "time would hold per process only (a tree of processes gets each limit once per "
                          f"process, /dev/shm aside), the process count {count}; set {KEY}.allow_no_cgroup=true "
                          "to run so")  # fmt: skip


def unreachable_images(backend: EnvBackend, images, workers: int = 8) -> dict[str, str]:
    """``{image: why}`` for each distinct image ``backend`` cannot use, in ``images``' order (each
    checked once; container engines are asked concurrently)."""
    distinct = list(dict.fromkeys(i for i in images if i))
    with ThreadPoolExecutor(max(1, min(workers, len(distinct)))) as pool:
        reasons = list(pool.map(backend.check_image, distinct))
    return {image: why for image, why in zip(distinct, reasons, strict=True) if why is not None}
