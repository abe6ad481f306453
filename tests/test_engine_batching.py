"""Submit batching (coordination/batch_window.h), threaded tier: while a caller keeps
submitting, the engine holds its own work back; a caller that waits, a pause of
RINGREDUCE_BATCH_US, or RINGREDUCE_BATCH_MAX_US ends the hold."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import world

import ringreduce as rr
from ringreduce.testing import run_threaded


def close(w):
    for c in w:
        c.close()


def responses(c):
    return c._engine.stats()["responses"]


def spaced_burst(c, count, pause_s):
    """``count`` async allreduces ``pause_s`` apart, then wait for all; return the
    results and how many responses the engine executed for them."""
    before = responses(c)
    hs = []
    for i in range(count):
        hs.append(c.allreduce_async(np.full(3, c.rank() + i, np.float32), op=rr.Sum,
                                    name=f"burst.{i}"))
        time.sleep(pause_s)
    out = [rr.synchronize(h) for h in hs]
    return out, responses(c) - before


def check_sums(results, n, count):
    for out, _ in results:
        for i, got in enumerate(out):
            np.testing.assert_array_equal(got, np.full(3, sum(r + i for r in range(n))))


def test_a_burst_goes_out_as_one_response():
    # Pauses of 20 ms stay inside a 5 s window: everything waits for the wait().
    w = world(2, RINGREDUCE_BATCH_US=5_000_000, RINGREDUCE_BATCH_MAX_US=10_000_000)
    try:
        results = run_threaded(2, lambda c: spaced_burst(c, 5, 0.02), world=w, timeout=60)
    finally:
        close(w)
    check_sums(results, 2, 5)
    assert [k for _, k in results] == [1, 1]


def test_without_batching_the_same_burst_splits():
    # The control for the test above: with the window off, every submit that
    # finds the engine idle starts a round of its own.
    w = world(2, RINGREDUCE_BATCH_US=0)
    try:
        results = run_threaded(2, lambda c: spaced_burst(c, 5, 0.02), world=w, timeout=60)
    finally:
        close(w)
    check_sums(results, 2, 5)
    assert all(k >= 2 for _, k in results), results


def test_a_waiting_caller_ends_the_hold_at_once():
    w = world(2, RINGREDUCE_BATCH_US=30_000_000, RINGREDUCE_BATCH_MAX_US=30_000_000)

    def body(c):
        t0 = time.perf_counter()
        got = c.allreduce(np.ones(4, np.float32), op=rr.Sum, name="blocking")
        return got, time.perf_counter() - t0

    try:
        results = run_threaded(2, body, world=w, timeout=60)
    finally:
        close(w)
    for got, took in results:
        np.testing.assert_array_equal(got, np.full(4, 2.0))
        assert took < 10, f"a blocking call waited {took:.1f} s for a 30 s window"


def test_a_pause_ends_the_hold():
    gap = 0.2
    w = world(2, RINGREDUCE_BATCH_US=int(gap * 1e6), RINGREDUCE_BATCH_MAX_US=30_000_000)

    def body(c):
        t0 = time.perf_counter()
        h = c.allreduce_async(np.ones(4, np.float32), op=rr.Sum, name="paused")
        early = rr.poll(h)  # nobody waits: the engine must still be holding it
        while not rr.poll(h):
            assert time.perf_counter() - t0 < 20, "the window never closed"
            time.sleep(0.005)
        return early, time.perf_counter() - t0, rr.synchronize(h)

    try:
        results = run_threaded(2, body, world=w, timeout=60)
    finally:
        close(w)
    for early, took, got in results:
        assert not early
        assert took >= 0.9 * gap, f"completed after {took:.3f} s, inside the {gap} s window"
        np.testing.assert_array_equal(got, np.full(4, 2.0))


def test_the_window_is_capped_for_a_caller_that_never_pauses():
    # Submits 10 ms apart never leave a 30 s gap; the 0.3 s cap must end the
    # hold while the caller is still submitting (it never waits before the end).
    w = world(2, RINGREDUCE_BATCH_US=30_000_000, RINGREDUCE_BATCH_MAX_US=300_000)

    def body(c):
        first = c.allreduce_async(np.ones(4, np.float32), op=rr.Sum, name="first")
        t0 = time.perf_counter()
        hs, i = [], 0
        while not rr.poll(first):
            assert time.perf_counter() - t0 < 20, "the capped window never closed"
            hs.append(c.allreduce_async(np.ones(2, np.float32), op=rr.Sum, name=f"more.{i}"))
            i += 1
            time.sleep(0.01)
        took = time.perf_counter() - t0
        # Both ranks submit the same names: stop at a count agreed over the wire.
        stop = int(c.allreduce(np.array([i], np.int64), op=rr.Max, name="count")[0])
        for j in range(i, stop):
            hs.append(c.allreduce_async(np.ones(2, np.float32), op=rr.Sum, name=f"more.{j}"))
        for h in hs:
            rr.synchronize(h)
        return took

    try:
        results = run_threaded(2, body, world=w, timeout=60)
    finally:
        close(w)
    assert all(took < 10 for took in results), results


def test_shutdown_ends_an_open_window():
    w = world(2, RINGREDUCE_BATCH_US=30_000_000, RINGREDUCE_BATCH_MAX_US=30_000_000)
    hs = [c.allreduce_async(np.ones(2, np.float32), name="held") for c in w]  # nobody waits
    t0 = time.perf_counter()
    close(w)
    assert time.perf_counter() - t0 < 5, "shutdown waited for the batching window"
    for h in hs:
        with pytest.raises(rr.RingReduceError, match="shut down"):
            h.wait()
