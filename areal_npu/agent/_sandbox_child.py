"""The child side of the execution sandbox: run as a script by ``python -I -S -B`` (never imported).

It reads one JSON payload from stdin (program, test inputs, nonce, limits), puts itself in a box
(network namespace, resource limits, an unprivileged uid, an audit hook), runs the untrusted program
once, calls ``f(input)`` for every test input and writes ONE result frame to the inherited result fd:
``<nonce> <json>\\n`` with one entry per input, ``{"ok": value}`` or ``{"err": "ExceptionName"}``.
It never sees the expected outputs; the parent compares. Protocol and threat model: ``sandbox.py``.

Only the standard library, and only modules imported before the box closes: once the uid is dropped
the interpreter's own directory may be unreadable (a pyenv under ``/root``), so the helpers a
one-line program may use are imported up front.
"""

# All imported before the uid drop; the noqa ones are helpers an answer may use.
import bisect  # noqa: F401
import builtins
import collections  # noqa: F401
import functools  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import operator  # noqa: F401
import os
import re  # noqa: F401
import resource
import signal
import string  # noqa: F401
import sys

BLOCKED_EXIT = 86  # the parent maps this exit status to reason "blocked_syscall"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# Audit events that are never legitimate in a one-line answer (prefix match).
_DENY_PREFIXES = (
    "socket.",
    "ctypes.",
    "subprocess.",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.system",
    "os.kill",
    "os.killpg",
    "os.putenv",
    "os.unsetenv",
    "os.setuid",
    "pty.",
    "gc.",
    "sys._getframe",
    "sys._current_frames",
    "sys.settrace",
    "sys.setprofile",
    "sys.addaudithook",
    "object.__getattr__",
    "object.__setattr__",
    "object.__delattr__",
    "resource.",
    "signal.",
    "mmap.",
    "urllib.",
    "http.",
    "ftplib.",
    "smtplib.",
    "webbrowser.",
    "sqlite3.",
    "marshal.",
    "pickle.",
    "code.__new__",
    "function.__new__",
    "builtins.input",
    "os.chdir",
    "os.chroot",
)
_DENY_IMPORTS = {
    "socket",
    "_socket",
    "ssl",
    "_ssl",
    "select",
    "selectors",
    "asyncio",
    "subprocess",
    "_posixsubprocess",
    "multiprocessing",
    "_multiprocessing",
    "ctypes",
    "_ctypes",
    "pty",
    "signal",
    "resource",
    "mmap",
    "threading",
    "_thread",
    "urllib",
    "http",
    "ftplib",
    "smtplib",
    "shutil",
    "tempfile",
    "gc",
    "inspect",
    "importlib",
    "pickle",
    "_pickle",
    "marshal",
    "sqlite3",
    "fcntl",
    "termios",
    "posix",
    "__main__",
}
_PATH_EVENTS = {
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.link",
    "os.symlink",
    "os.truncate",
    "os.utime",
    "os.chflags",
    "os.lchflags",
    "os.lchmod",
    "os.setxattr",
    "os.removexattr",
}


def _unshare_network() -> str:
    """A fresh network namespace has only a down loopback: no route anywhere. Best effort."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        clone_newnet, clone_newuser = 0x40000000, 0x10000000
        if libc.unshare(clone_newnet) == 0:
            return "netns"
        if libc.unshare(clone_newuser | clone_newnet) == 0:  # unprivileged user namespace
            return "userns+netns"
    except Exception:
        pass
    finally:
        for name in ("ctypes", "_ctypes", "ctypes._endian"):
            sys.modules.pop(name, None)  # a later `import ctypes` must go through the import hook
    return ""


def _set_limits(lim: dict, jailed: bool) -> list:
    def cap(kind, soft, hard=None):
        hard = soft if hard is None else hard
        old_soft, old_hard = resource.getrlimit(kind)
        if old_hard != resource.RLIM_INFINITY:
            hard, soft = min(hard, old_hard), min(soft, old_hard)
        resource.setrlimit(kind, (soft, hard))

    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_AS, lim["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, lim["output_bytes"])
    cap(resource.RLIMIT_NOFILE, lim["max_open_files"])
    if not jailed:  # in the jail the uid maps to the trainer's: its control group counts processes
        cap(resource.RLIMIT_NPROC, lim["max_processes"])
    cap(resource.RLIMIT_CPU, lim["cpu_seconds"], lim["cpu_seconds"] + 1)
    return ["rlimits"]


def _drop_privileges(uid, gid) -> list:
    if uid is None or os.geteuid() != 0:
        return []
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # RLIMIT_NPROC now counts this uid, which only this sandbox uses
    return ["uid"]


def _install_audit_hook(workdir: str) -> None:
    workdir = os.path.normpath(workdir)
    deny, deny_imports, path_events, write_flags = _DENY_PREFIXES, _DENY_IMPORTS, _PATH_EVENTS, _WRITE_FLAGS
    write, exit_now, normpath, join, sep = os.write, os._exit, os.path.normpath, os.path.join, os.sep

    def inside(path) -> bool:
        if isinstance(path, int):
            return True
        if isinstance(path, bytes):
            path = path.decode("utf-8", "replace")
        path = normpath(join(workdir, str(path)))
        return path == workdir or path.startswith(workdir + sep)

    def block(event: str) -> None:
        write(2, f"\nareal-sandbox: blocked {event}\n".encode())
        exit_now(BLOCKED_EXIT)  # not an exception: the program cannot catch it and carry on

    def hook(event, args):
        if event.startswith(deny):
            block(event)
        elif event == "import":
            if args[0].partition(".")[0] in deny_imports:
                block(f"import {args[0]}")
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, (str, bytes)):
                text = path.decode("utf-8", "replace") if isinstance(path, bytes) else path
                if text.startswith(("/proc", "/sys", "/dev/shm")):
                    block(f"open {text}")
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path):
                block(f"open {path!r} for writing")
        elif event in path_events:
            if not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
                block(f"{event} {args[:2]!r}")

    sys.addaudithook(hook)


def _plain(value, depth=0):
    """The answer as plain JSON data (exact builtin types only), so the parent never runs its methods."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:  # non-finite floats are tagged, so they never equal the strings "nan"/"inf"
        if value != value:
            return {"float": "nan"}
        return {"float": "inf" if value > 0 else "-inf"} if abs(value) == float("inf") else value
    if kind in (list, tuple) and depth < 8 and len(value) <= 10_000:
        return [_plain(v, depth + 1) for v in value]
    raise TypeError(f"unsupported answer type {kind.__name__}")


def main() -> None:
    payload = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    result_fd, prefix = payload["result_fd"], payload["nonce"].encode() + b" "
    jailed = bool(payload.get("jailed"))
    layers = ["clean_env", "workdir", "new_session"]
    net = "" if jailed else _unshare_network()  # the jail has its own network namespace already
    layers += [net] if net else []
    layers += _set_limits(payload["limits"], jailed)
    layers += _drop_privileges(payload.get("uid"), payload.get("gid"))
    for path in payload.get("sys_path", []):  # the repository under test, for repo grading
        sys.path.insert(0, path)
    # Bytecode caches beside the sources are ignored: a stale one (same size, same second) would
    # grade the repository as it was, not as it is.
    sys.pycache_prefix = "/tmp/.pycache" if jailed else None
    os.umask(0o077)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # CPython ignores it; the parent wants the kill
    if payload["audit"]:
        _install_audit_hook(os.getcwd())
        layers.append("audit_hook")

    results, reason = [], ""
    inputs, max_len = payload["inputs"], payload["limits"]["output_bytes"]
    try:
        code = compile(payload["program"], "<program>", "exec")
    except (SyntaxError, ValueError):
        reason = "syntax_error"
    else:
        # A copy of the builtins: rebinding `type` or `len` there cannot reach the harness.
        scope = {"__builtins__": dict(builtins.__dict__), "__name__": "program"}
        try:
            exec(code, scope)
            func = scope["f"]
        except MemoryError:
            reason = "memory"
        except BaseException:  # noqa: BLE001 - any failure of the program (or no `f`) is its own fault
            reason = "crash"
        else:
            for value in inputs:
                try:
                    out = _plain(func(value))
                    text = json.dumps(out, allow_nan=False)
                    results.append({"ok": out} if len(text) <= max_len else {"err": "OutputTooLong"})
                except RecursionError:
                    results.append({"err": "RecursionError"})
                except BaseException as exc:  # noqa: BLE001
                    results.append({"err": type(exc).__name__})
    frame = json.dumps(
        {"results": results, "reason": reason, "layers": layers}, separators=(",", ":"), allow_nan=False
    )
    os.write(result_fd, prefix + frame.encode() + b"\n")
    os._exit(0)


if __name__ == "__main__":
    main()
