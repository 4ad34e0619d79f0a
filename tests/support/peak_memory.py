"""Peak bytes of live torch tensors over a block of code, on the CPU (test helper).

Method: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of torch's
CPU allocator as a ``[memory]`` event with a signed byte count. Replaying them in time order gives
the live bytes at every instant; the peak is the running maximum. Unlike the process RSS it does
not see allocator caching, the Python heap or library scratch memory (oneDNN / BLAS workspaces),
and it is deterministic: the same code gives the same peak on every run.

Only allocations made inside the block are tracked: a tensor that existed before the block and is
freed inside it is not subtracted (the profiler never saw it allocated), so the result is the peak
of bytes *added* by the block, never less. To count everything (parameters, optimizer states),
build them inside the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class PeakMemory:
    peak_bytes: int = 0  # the running maximum of live bytes allocated inside the block
    end_bytes: int = 0  # still live at the end of the block

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


@contextmanager
def peak_memory() -> Iterator[PeakMemory]:
    """``with peak_memory() as m: ...``; then ``m.peak_bytes``."""
    from torch.profiler import ProfilerActivity, profile

    result = PeakMemory()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())  # stable: same-instant events keep their record order
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    result.peak_bytes, result.end_bytes = peak, live
