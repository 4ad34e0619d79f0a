"""The staleness gate on simulated asynchronous runs, against the bound it promises."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_npu.staleness import StalenessGate


def simulate(batch, eta, steps, seed, max_concurrent=6, start_step=0):
    """Producers finish after random delays; the trainer consumes `batch` groups per step and bumps
    the version. Returns (staleness of every consumed group, dropped count, admission versions by step)."""
    rng = random.Random(seed)
    gate = StalenessGate.resumed(batch, eta, start_step)
    version = start_step
    in_flight = []  # (finish_time, start_version)
    buffer = []
    now = 0.0
    consumed = []
    starts_per_step = {}
    for step in range(start_step, steps):
        got = []
        while len(got) < batch:
            while gate.can_admit(version) and len(in_flight) < max_concurrent:
                gate.admit()
                in_flight.append((now + rng.expovariate(1.0), version))
                starts_per_step.setdefault(version, 0)
                starts_per_step[version] += 1
            if not buffer:
                assert in_flight, "deadlock: nothing in flight and nothing buffered"
                in_flight.sort()
                now, v = in_flight.pop(0)
                buffer.append(v)
            v = buffer.pop(0)
            if gate.fresh_enough(step, v):
                gate.consume()
                got.append(step - v)
            else:
                gate.drop()
        consumed.extend(got)
        version += 1
    return consumed, gate.dropped, starts_per_step


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 6), eta=st.integers(0, 3), seed=st.integers(0, 10_000), conc=st.integers(1, 12))
def test_every_consumed_group_respects_the_bound(batch, eta, seed, conc):
    consumed, _, _ = simulate(batch, eta, steps=12, seed=seed, max_concurrent=conc)
    assert len(consumed) == 12 * batch
    assert max(consumed) <= eta and min(consumed) >= 0


def test_zero_staleness_is_synchronous():
    consumed, dropped, starts = simulate(batch=4, eta=0, steps=10, seed=3, max_concurrent=100)
    assert set(consumed) == {0} and dropped == 0
    # exactly one batch is admitted per version: generation for step s starts only once version s is served
    assert all(n == 4 for n in starts.values())


def test_staleness_is_used_when_allowed():
    consumed, _, _ = simulate(batch=2, eta=2, steps=20, seed=1, max_concurrent=100)
    assert max(consumed) == 2  # asynchrony really happens, up to the bound


def test_resume_keeps_the_bound():
    consumed, _, starts = simulate(batch=3, eta=1, steps=15, seed=5, start_step=7)
    assert len(consumed) == 8 * 3 and max(consumed) <= 1
    assert min(starts) == 7  # nothing admitted against versions before the checkpoint
