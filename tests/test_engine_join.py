"""Threaded tier of the engine, join: ranks that run out of data call ``join()`` while the
others go on; the joined rank contributes neutral elements (zeros for a sum and average,
the identity for min, max and product), packs them while the others fuse in place, and
an unmatched join warns, then fails, instead of hanging."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import world

import ringreduce as rr
from ringreduce.testing import run_threaded


def test_join_with_uneven_steps_averages_over_contributors():
    n = 3

    def body(c):
        r = c.rank()
        outs = []
        for step in range(r + 2):  # rank r has r + 2 batches
            outs.append(c.allreduce(np.full(4, float(r + 1), np.float32), name="grad",
                                    op=rr.Average))
            c.allgather(np.full((1, 2), r), name=f"ag{step}")
        last = c.join()
        return outs, last

    res = run_threaded(n, body)
    for r, (outs, last) in enumerate(res):
        assert last == n - 1  # rank 2 has the most batches: it joins last
        want = [2.0, 2.0, 2.5, 3.0]  # avg of ranks {1,2,3}, {1,2,3}, {2,3}, {3}
        assert [o[0] for o in outs] == want[:r + 2]
    again = run_threaded(n, lambda c: c.allreduce(np.ones(2), op=rr.Sum))
    assert all((a == n).all() for a in again)


def test_unnamed_calls_agree_again_after_an_uneven_join():
    """Ranks with more batches make more unnamed calls before they join; once all have
    joined, the next unnamed calls (a metric's allreduce, an unnamed group) must match."""

    def body(c):
        r = c.rank()
        got = []
        for epoch in range(2):
            for _ in range(r + 1 + epoch):  # uneven, and differently so in each epoch
                c.allreduce(np.ones(2, np.float32), op=rr.Sum)
                c.grouped_allreduce_async([np.ones(2, np.float32)], op=rr.Sum).wait()
            c.join()
            got.append(float(c.allreduce(np.ones(2, np.float32), op=rr.Sum)[0]))
            h = c.grouped_allreduce_async([np.ones(3, np.float32)], op=rr.Sum)
            got.append(float(h.wait()[0][0]))
        return got

    w = world(2, RINGREDUCE_STALL_CHECK_SECONDS="1", RINGREDUCE_STALL_SHUTDOWN_SECONDS="3")
    assert run_threaded(2, body, world=w, timeout=60, return_exceptions=True) == [[2.0] * 4] * 2
    for c in w:
        c.close()


def test_a_tensor_submitted_right_before_the_last_join_completes():
    """Rank 1 has joined; rank 0 submits 'x' and joins at once (a wide batch window puts
    both in one round). 'x' runs with rank 1's zeros before join() returns on any rank."""

    def body(c):
        if c.rank() == 1:
            return c.join()
        time.sleep(0.3)
        h = c.allreduce_async(np.ones(4, np.float32), op=rr.Sum, name="x")
        last = c.join()
        deadline = time.monotonic() + 2
        while not h.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        return last, h.done() and h.wait().tolist()

    w = world(2, RINGREDUCE_BATCH_US="100000", RINGREDUCE_BATCH_MAX_US="1000000")
    try:
        assert run_threaded(2, body, world=w, timeout=30) == [(0, [1.0] * 4), 0]
    finally:
        for c in w:
            c.close()


def test_a_tensor_named_join_does_not_block_join():
    def body(c):
        h = c.allreduce_async(np.ones(3, np.float32), op=rr.Sum, name="join")
        last = c.join()
        return last, h.wait().tolist()

    out = run_threaded(2, body, timeout=30)
    assert [o[1] for o in out] == [[2.0] * 3] * 2 and out[0][0] == out[1][0]


def test_join_neutral_elements_for_min_max_product():
    def body(c):
        if c.rank() == 1:
            return c.join()
        x = np.array([3, -2], np.int32)
        out = [c.allreduce(x, op=op, name=f"op{op}") for op in (rr.Min, rr.Max, rr.Product)]
        c.join()
        return out

    out = run_threaded(2, body)[0]
    assert [o.tolist() for o in out] == [[3, -2], [3, -2], [3, -2]]


def test_joined_rank_packs_while_others_fuse_in_place():
    def body(c):
        if c.rank() == 1:
            return c.join()
        xs = [np.full(s, c.rank() + 1.0, np.float32) for s in (50000, 3, 70000)]
        hs = [c.allreduce_async(x, op=rr.Average, name=f"j{i}") for i, x in enumerate(xs)]
        out = [h.wait() for h in hs]
        c.join()
        return out

    res = run_threaded(3, body)
    for r in (0, 2):
        for o in res[r]:
            assert (o == 2.0).all()  # average of 1 and 3 over the two contributors


def test_joined_rank_neutral_elements_survive_prescale():
    def body(c):
        if c.rank() == 1:
            return c.join()
        x = np.array([3.0, -2.0])
        out = [c.allreduce(x, op=rr.Product, prescale_factor=2.0, name="p"),
               c.allreduce(x, op=rr.Min, prescale_factor=-1.0, name="mn"),
               c.allreduce(x, op=rr.Max, prescale_factor=0.5, name="mx")]
        c.join()
        return out

    p, mn, mx = run_threaded(2, body)[0]
    assert p.tolist() == [6.0, -4.0] and mn.tolist() == [-3.0, 2.0] and mx.tolist() == [1.5, -1.0]


def test_unmatched_join_warns_then_fails_instead_of_hanging(capfd):
    w = world(2, RINGREDUCE_STALL_CHECK_SECONDS="0.3", RINGREDUCE_STALL_SHUTDOWN_SECONDS="1")

    def body(c):
        t0 = time.monotonic()
        if c.rank() == 0:
            with pytest.raises(rr.RingReduceTimeoutError, match="join\\(\\): rank 0 joined"):
                c.join()  # rank 1 never joins and never submits anything
            return time.monotonic() - t0
        time.sleep(2.0)
        with pytest.raises(rr.RingReduceError, match="stopped after an earlier failure"):
            c.allreduce(np.ones(2))
        return None

    took = run_threaded(2, body, world=w, timeout=30)[0]
    assert took < 4
    assert "rank 1 neither joined nor submitted anything" in capfd.readouterr().err
    for c in w:
        c.close()
