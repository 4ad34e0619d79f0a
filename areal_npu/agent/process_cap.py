"""The process count of a jail without a control group: RLIMIT_NPROC in the jail's own user namespace.

The kernel counts RLIMIT_NPROC per user *in the user namespace* a task's credentials live in, and
checks each level up to the initial namespace against the limit that level was created under. A
bwrap jail is a fresh user namespace whose only user is the jail's, so a limit set inside it counts
the jail's own tasks (threads too, like a control group's ``pids.max``), never the trainer user's
other processes (tests/agent/test_process_cap.py forks past it with ten of the user's processes
beside). Set before the namespace is made, the limit would be recorded as that namespace's cap on
the creating user's processes all together, so it is set on the jail's first process from outside,
before that process starts the command (bwrap's ``--info-fd`` / ``--block-fd``).

The kernel never checks RLIMIT_NPROC for the global root uid, and a jail started by root runs as
that uid (bwrap maps the jail's uid to the trainer's): there only a control group bounds the count.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import time


def nproc_rlimit_holds() -> bool:
    """Whether RLIMIT_NPROC bounds a jail's tasks here: not for a root trainer (module docstring)."""
    return os.geteuid() != 0


class ProcessCap:
    """RLIMIT_NPROC = ``count`` on the jail's first process, set from outside before it starts the
    command: bwrap reports that process on ``--info-fd`` and waits on ``--block-fd``."""

    def __init__(self):
        self.info_r, self.info_w = os.pipe()
        self.block_r, self.block_w = os.pipe()

    def options(self) -> list[str]:
        return ["--info-fd", str(self.info_w), "--block-fd", str(self.block_r)]

    def child_fds(self) -> tuple[int, int]:
        return self.info_w, self.block_r

    def apply(self, count: int, timeout: float) -> bool:
        """Cap the jail's first process (the command inherits it), then let it go on; False when bwrap
        ended before it said which process that is, or the cap could not be set."""
        os.close(self.info_w)
        os.close(self.block_r)
        try:
            pid = self._child_pid(time.monotonic() + timeout)
            if pid is None:
                return False
            resource.prlimit(pid, resource.RLIMIT_NPROC, (count, count))
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.write(self.block_w, b"1")  # the command starts (it would on EOF as well)
            os.close(self.block_w)
            os.close(self.info_r)

    def close(self) -> None:
        """Popen failed: nothing reads or writes the pipes."""
        for fd in (self.info_r, self.info_w, self.block_r, self.block_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _child_pid(self, deadline: float) -> int | None:
        data = b""
        while (left := deadline - time.monotonic()) > 0 and select.select([self.info_r], [], [], left)[0]:
            chunk = os.read(self.info_r, 4096)
            if not chunk:
                return None
            data += chunk
            try:
                return int(json.loads(data)["child-pid"])
            except ValueError:  # not all of it yet
                continue
            except (KeyError, TypeError):
                return None
        return None
