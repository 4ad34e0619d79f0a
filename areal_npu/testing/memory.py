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


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """Serve every allocation of at least ``threshold`` bytes by its own mapping, unmapped at free
    (glibc ``mallopt(M_MMAP_THRESHOLD)``). glibc raises that threshold to the size of each mapping
    freed, up to 32 MiB, and from then on keeps such blocks in the heap, resident after they are
    freed: a small model's tensors (all under 32 MiB) would then count memory that is no longer in
    use, where a large model's (above it) would not. False without glibc."""
    try:
        return bool(_libc().mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``), so that a peak measured from
    here counts memory a later phase re-uses from the heap (freed by an earlier one, still resident)
    as growth; False without glibc."""
    import gc

    gc.collect()
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False
