"""This process's resident memory from Linux ``/proc/self`` (benchmarks' peak-RSS columns)."""

from __future__ import annotations


def status_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory line (``VmRSS``, ``VmHWM``, ...) in bytes; 0 where absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
