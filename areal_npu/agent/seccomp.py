"""A seccomp deny-list for jailed programs, as the classic-BPF program ``bwrap --seccomp FD`` loads.

Why a deny-list and not Docker's allow-list: the jail already holds the filesystem, network and
process view (namespaces); seccomp only has to take away the kernel interfaces that reach past a
namespace or widen the kernel's attack surface (debugging other processes, mounting, new
namespaces, keyrings, eBPF, perf, module and kexec loading, io_uring, handle-based opens). Denied
calls fail with EPERM so ordinary programs that probe for them (Python's ``os`` module does) carry
on; a foreign ABI (x32 on x86_64, or any architecture the table does not describe) is killed,
because its syscall numbers would slip past the table.

The numbers are the kernel's UAPI ones (``asm/unistd_64.h`` for x86_64, ``asm-generic/unistd.h``
for aarch64, the Ascend hosts' architecture).
"""

from __future__ import annotations

import errno
import platform
import struct

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
    "name_to_handle_at", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "syslog", "swapon", "swapoff", "reboot", "acct", "quotactl", "fsopen", "fsmount", "move_mount",
    "open_tree",
)  # fmt: skip

_COMMON = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
           "move_mount": 429, "fsopen": 430, "fsmount": 432}  # fmt: skip
SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
        "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248,
        "request_key": 249, "bpf": 321, "perf_event_open": 298, "kexec_load": 246,
        "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "userfaultfd": 323, "syslog": 103,
        "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163, "quotactl": 179, **_COMMON,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40, "umount2": 39,
        "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268, "keyctl": 219, "add_key": 217,
        "request_key": 218, "bpf": 280, "perf_event_open": 241, "kexec_load": 104,
        "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "userfaultfd": 282, "syslog": 116,
        "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89, "quotactl": 60, **_COMMON,
    },
}  # fmt: skip
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def supported_machine(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in SYSCALLS


def deny_filter(machine: str | None = None) -> bytes:
    """The BPF program (an array of ``struct sock_filter``) denying :data:`DENIED` with EPERM."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise ValueError(f"no syscall table for machine {machine!r}; known: {', '.join(SYSCALLS)}")
    numbers = sorted({SYSCALLS[machine][name] for name in DENIED})
    n = len(numbers)
    prog = [
        _insn(_LD_W_ABS, _OFFSET_ARCH),
        _insn(_JEQ_K, AUDIT_ARCH[machine], jt=1),
        _insn(_RET_K, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _OFFSET_NR),
    ]
    if machine == "x86_64":  # x32 numbers alias the 64-bit ones with a high bit: kill them all
        prog.append(_insn(_JGE_K, _X32_SYSCALL_BIT, jt=n + 2))
    # instruction i jumps over the remaining n-1-i comparisons and the ALLOW to the ERRNO return
    prog += [_insn(_JEQ_K, nr, jt=n - i) for i, nr in enumerate(numbers)]
    prog += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_ERRNO | errno.EPERM)]
    if machine == "x86_64":
        prog.append(_insn(_RET_K, _RET_KILL_PROCESS))
    return b"".join(prog)
