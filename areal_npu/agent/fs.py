"""Filesystem chores shared by the environments: size-capped areas for repository copies, what a tree
holds, and removing trees a jailed program may have locked.

An *area* is a tmpfs mounted on an empty directory with a byte cap (``size=``) and a cap on inodes
(``nr_inodes=``; tmpfs charges one for every file, directory, symlink and extra hard link). A copy
inside one cannot take more of the host than its caps, whatever a program writes (paths past
PATH_MAX, hard links, sparse files, empty files), and is gone in one ``umount``. Mounting needs
CAP_SYS_ADMIN in the trainer's mount namespace (root in its container); without it
:func:`make_area` says no and callers fall back to measuring trees (:func:`tree_bytes`). An area's
pages are RAM (or swap), not disk.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
FULL_SLACK = 64 << 10  # an area with less than this free (or no free inode) is full
_AREAS: set[str] = set()  # mount points this process made (and removes)
_LOCK = threading.Lock()


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: Path, max_bytes: int, max_files: int) -> None:
    opts = f"size={int(max_bytes)},nr_inodes={int(max_files)},mode=0755".encode()
    if _libc().mount(b"areal-area", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _umount(path: str) -> None:
    _libc().umount2(os.fsencode(path), _MNT_DETACH)


@atexit.register
def _unmount_all() -> None:
    """Areas outlive the process that mounted them: the ones not removed yet go when it exits (a
    trainer killed with SIGKILL leaves them mounted until its container ends)."""
    with _LOCK:
        areas = sorted(_AREAS, key=len, reverse=True)
        _AREAS.clear()
    for area in areas:
        _umount(area)


@functools.cache
def areas_supported() -> tuple[bool, str]:
    """Whether this process can mount areas (probed once), and why not."""
    probe = tempfile.mkdtemp(prefix="areal-area-probe-")
    try:
        _mount_tmpfs(Path(probe), 1 << 20, 16)
        _umount(probe)
        return True, ""
    except OSError as exc:
        why = f"cannot mount a tmpfs ({exc.strerror}): needs CAP_SYS_ADMIN in the trainer's mount namespace"
        return False, why
    finally:
        os.rmdir(probe)


def make_area(path: Path, max_bytes: int, max_files: int) -> bool:
    """The empty directory ``path`` becomes an area of ``max_bytes`` and ``max_files`` inodes; False
    (and nothing mounted) when this process cannot mount one."""
    if not areas_supported()[0]:
        return False
    try:
        _mount_tmpfs(path, max_bytes, max_files)
    except OSError:
        return False
    with _LOCK:
        _AREAS.add(os.path.abspath(path))
    return True


def area_of(path: Path) -> str | None:
    """The area ``path`` lies in (its mount point), None when it lies in none of this process's."""
    p = os.path.abspath(path)
    with _LOCK:
        return next((a for a in _AREAS if p == a or p.startswith(a + "/")), None)


def area_usage(area: str) -> tuple[int, int, bool]:
    """``(bytes used, inodes used, full)`` of an area (statvfs: one call, however big the tree)."""
    st = os.statvfs(area)
    full = st.f_bavail * st.f_frsize < FULL_SLACK or st.f_favail == 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree, full


def _du(path: Path, *flags: str) -> int:
    res = subprocess.run(["du", "-s", *flags, "--", str(path)], capture_output=True, text=True)
    try:  # du still prints the total when files vanish while it walks (and exits 1)
        return int(res.stdout.split()[0])
    except (IndexError, ValueError):
        return 0


def tree_usage(path: Path, apparent: bool = False) -> tuple[int, int]:
    """``(bytes, entries)`` under ``path`` by coreutils' ``du``, which walks trees of any depth (past
    PATH_MAX, past Python's recursion limit) and follows no symlink. Bytes: the disk blocks
    allocated, each inode once (a hard-linked file is one file, a sparse file counts what it holds);
    ``apparent``: each path's size (what a program reading every path, as git does, reads). Entries:
    every path below ``path``, hard links included (tmpfs charges each an inode)."""
    held = _du(path, "-B1", "--apparent-size", "--count-links") if apparent else _du(path, "-B1")
    return held, max(0, _du(path, "--inodes", "--count-links") - 1)


def tree_bytes(paths: list[Path]) -> int:
    """Disk blocks allocated under ``paths`` (:func:`tree_usage`): what the host's disk pays for."""
    return sum(tree_usage(p)[0] for p in paths)


def copy_tree(src: Path, dest: Path) -> None:
    """``dest`` (absent, or an empty directory) becomes a copy of ``src``: symlinks kept as links, hard
    links kept as links, holes kept as holes, modes and times kept; copy-on-write where the
    filesystem can."""
    cp = shutil.which("cp")
    if cp is not None:
        existed = dest.is_dir()
        dest.mkdir(exist_ok=True)
        argv = [cp, "-a", "--reflink=auto", "--sparse=always", f"{src}/.", f"{dest}/"]
        if subprocess.run(argv, capture_output=True).returncode == 0:
            return
        for child in list(dest.iterdir()) if existed else ():
            remove_tree(child)
        if not existed:
            remove_tree(dest)
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)


def copy_into_area(src: Path, dest: Path, max_bytes: int, room_bytes: int, room_files: int) -> bool:
    """``dest`` (absent) becomes a copy of ``src`` inside an area of its own, when this process can
    mount one: ``max(max_bytes, what src holds + room_bytes)`` bytes and what src holds + ``room_files``
    inodes. True when it is in an area; False: a plain copy (no bound)."""
    dest.mkdir()
    held, entries = tree_usage(src)
    bounded = make_area(dest, max(int(max_bytes), held + int(room_bytes)), entries + int(room_files) + 16)
    copy_tree(src, dest)
    return bounded


def move_tree(src: Path, dest: Path) -> None:
    """Rename ``src`` to ``dest`` (absent, or an empty directory) with the areas below it."""
    os.replace(src, dest)
    old, new = os.path.abspath(src), os.path.abspath(dest)
    with _LOCK:
        moved = {a for a in _AREAS if a.startswith(old + "/")}
        _AREAS.difference_update(moved)
        _AREAS.update(new + a[len(old) :] for a in moved)


def remove_tree(path: Path) -> None:
    """Remove a tree a jailed program may have made unwritable (chmod 000 directories); the areas at or
    under it are unmounted (their contents go with them, however deep); a missing path is fine."""
    p = os.path.abspath(path)
    with _LOCK:
        inside = sorted((a for a in _AREAS if a == p or a.startswith(p + "/")), key=len, reverse=True)
        _AREAS.difference_update(inside)
    for area in inside:
        _umount(area)

    def make_writable_and_retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), stat.S_IRWXU)
            os.chmod(target, stat.S_IRWXU)
            func(target)
        except OSError:
            pass

    if not os.path.lexists(path):
        return
    try:
        shutil.rmtree(path, onerror=make_writable_and_retry)
    except RecursionError:
        # Python < 3.12's rmtree recurses once per directory level: a tree deeper than the recursion
        # limit (an agent's `while :; do mkdir a && cd a; done`) is left to coreutils, which walk it
        # iteratively (neither follows symbolic links)
        subprocess.run(["chmod", "-R", "u+rwx", str(path)], capture_output=True)
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True)


class DiskWatch:
    """The bound on a command's writable directories while it runs. In areas: the kernel's caps hold,
    and the command counts as past them (``exceeded``) when an area is full and it grew in this command.
    Elsewhere: :func:`tree_bytes` measured every ``poll_s`` against ``max(max_bytes, what they held at
    the start)`` (a fast writer overshoots by what it writes in one poll)."""

    def __init__(self, paths: list[Path], max_bytes: int, poll_s: float = 0.5):
        self.paths, self.poll_s, self.next = list(paths), poll_s, 0.0
        self.areas = [area_of(p) for p in self.paths]
        self.bounded = bool(self.paths) and all(self.areas)
        if self.bounded:
            self.start = [area_usage(a)[:2] for a in self.areas]
        else:
            self.allowed = max(int(max_bytes), tree_bytes(self.paths)) if self.paths else 0

    @property
    def layer(self) -> str:
        return "disk_area" if self.bounded else "disk_quota_polled"

    def exceeded(self, final: bool = False) -> bool:
        if not self.paths:
            return False
        if self.bounded:
            for area, (used, files) in zip(self.areas, self.start, strict=True):
                now_used, now_files, full = area_usage(area)
                if full and (now_used > used or now_files > files):
                    return True
            return False
        now = time.monotonic()
        if not final and now < self.next:
            return False
        self.next = now + self.poll_s
        return tree_bytes(self.paths) > self.allowed
