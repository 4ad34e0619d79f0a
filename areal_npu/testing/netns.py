"""Two "nodes" on one machine: two network namespaces joined by a veth pair (root and iproute2).

Each namespace has ``lo`` and one end of the pair, both named :data:`IFNAME`, with ``10.213.0.1``
(node a) and ``10.213.0.2`` (node b): the only route between the two "nodes" is the veth, so a
process in one reaches the other by its address over the pair, as across a real network (the
file system and process table stay shared). :func:`node_pair` creates them and always removes
them: every process left in either namespace is SIGKILLed first (found through
``/proc/<pid>/ns/net``, so children started anywhere below count too), then the namespaces go,
and their veth with them. :func:`unavailable` says why this machine cannot do it (not root, no
``ip``); :func:`node_pair` raises :class:`NetnsUnavailable` with ``ip``'s own words when creating
fails (no CAP_NET_ADMIN in a container, no veth module).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

IFNAME = "areal0"  # the veth end's name in both namespaces (GLOO_SOCKET_IFNAME on every "node")
SUBNET = "10.213.0"
_CLONE_NEWNET = 0x40000000


class NetnsUnavailable(RuntimeError):
    """The namespaces or their veth could not be made here; the message says why."""


def unavailable() -> str | None:
    """Why :func:`node_pair` cannot work on this machine, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its address on the veth."""

    netns: str
    addr: str

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside this namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.netns, *command]

    def inode(self) -> int:
        return os.stat(f"/run/netns/{self.netns}").st_ino

    def pids(self) -> list[int]:
        """Every process whose network namespace is this one (read from ``/proc``)."""
        want, out = f"net:[{self.inode()}]", []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/ns/net") == want:
                        out.append(int(entry))
        return out

    def holds(self, pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{pid}/ns/net") == f"net:[{self.inode()}]"
        except OSError:
            return False

    def call(self, fn: Callable[[], object], timeout: float = 60.0) -> object:
        """``fn()`` in a thread of this process moved into this namespace (``setns`` acts on the
        calling thread only): the sockets it opens reach the other node over the veth."""
        result: dict = {}

        def target() -> None:
            fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            try:
                result["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result["error"] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(timeout)
        if "error" in result:
            raise result["error"]
        if "value" not in result:
            raise TimeoutError(f"no answer within {timeout} s in {self.netns}")
        return result["value"]


def kill_all(nodes: tuple[Node, ...], grace_s: float = 5.0) -> list[int]:
    """SIGKILL every process in ``nodes``' namespaces until none is left; returns those killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        left = [pid for node in nodes for pid in node.pids()]
        if not left or time.monotonic() > deadline:
            return sorted(killed)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.2)


@contextlib.contextmanager
def node_pair(tag: str | None = None) -> Iterator[tuple[Node, Node]]:
    """Two namespaces joined by a veth pair, named after ``tag`` (default: this process's id);
    removed on exit, after every process in them is killed, whatever happened inside."""
    reason = unavailable()
    if reason:
        raise NetnsUnavailable(reason)
    tag = tag or str(os.getpid())
    a, b = Node(f"areal-a-{tag}", f"{SUBNET}.1"), Node(f"areal-b-{tag}", f"{SUBNET}.2")
    made: list[Node] = []
    try:
        for node in (a, b):
            _ip("netns", "add", node.netns)
            made.append(node)
        _ip("link", "add", IFNAME, "netns", a.netns, "type", "veth", "peer", "name", IFNAME, "netns", b.netns)
        for node in (a, b):
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
            _ip("-n", node.netns, "link", "set", IFNAME, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        with contextlib.suppress(OSError):
            kill_all(tuple(made))
        for node in made:
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True, timeout=30)
