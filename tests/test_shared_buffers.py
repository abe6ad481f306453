"""Shared buffers (``shared_zeros``, collectives/allreduce_shared.cc), threaded tier.

An allreduce whose tensors lie at the same place of one shared buffer on every rank reads
the peers' data where it lies; anything else takes the ring. ``Engine.stats()`` counts the
allreduces that went the shared way, so every test checks which path ran, not only the
result.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from conftest import DTYPES, OPS, contribution, env, reference, tolerance

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

COUNT = 100_003  # above the direct path's 64 KiB for every dtype, odd for every split


def shared_count(c) -> int:
    return c._engine.stats()["shared_allreduces"]


def with_world(n, fn, **settings):
    settings.setdefault("RINGREDUCE_SHARED_MIN_BYTES", 0)  # the path at every size
    with env(**settings):
        w = make_world(n)
    try:
        return run_threaded(n, fn, world=w, timeout=120)
    finally:
        for c in w:
            c.close()


def supported(dtype, op) -> bool:
    return not (np.dtype(dtype) == np.bool_ and op == rr.Average)


def check_close(got, inputs, op, dtype, n, key):
    want = reference(inputs, op, dtype)
    tol = tolerance(dtype, op, n)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol, err_msg=key)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_dtype_and_op_over_a_shared_buffer(n):
    def body(c):
        out, ran = {}, 0
        for dtype in DTYPES:
            buf = c.shared_zeros(COUNT, dtype)
            for op in OPS:
                if not supported(dtype, op):
                    continue
                buf[:] = contribution(c.rank(), COUNT, dtype, seed=op)
                before = shared_count(c)
                c.allreduce_(buf, op=op, name=f"{np.dtype(dtype).name}.{op}")
                ran += shared_count(c) - before
                out[(np.dtype(dtype).name, op)] = buf.copy()
        return out, ran

    results = with_world(n, body)
    for key, got0 in results[0][0].items():
        dtype = next(d for d in DTYPES if np.dtype(d).name == key[0])
        for r in range(n):
            assert results[r][0][key].tobytes() == got0.tobytes(), f"{key}: rank {r} differs"
        inputs = [contribution(r, COUNT, dtype, seed=key[1]) for r in range(n)]
        check_close(got0, inputs, key[1], dtype, n, str(key))
    assert all(ran == len(results[0][0]) for _, ran in results), [ran for _, ran in results]


def test_prescale_postscale_and_out_of_place_input():
    def body(c):
        buf = c.shared_zeros(COUNT, np.float64)
        src = contribution(c.rank(), COUNT, np.float64, seed=1)
        buf[:] = src
        before = shared_count(c)
        c.allreduce_(buf, op=rr.Average, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
        return buf.copy(), shared_count(c) - before

    results = with_world(3, body)
    want = sum(contribution(r, COUNT, np.float64, seed=1) for r in range(3)) / 3
    for got, ran in results:
        np.testing.assert_allclose(got, want, rtol=1e-14)
        assert ran == 1


def views_of(buf, sizes):
    ends = np.cumsum(sizes)
    return [buf[e - s:e] for s, e in zip(sizes, ends)]


SIZES = [70_000, 3, 200_001, 17, 5_000, 90_000, 1, 33_333]


def fused_step(c, buf, order, base_seed):
    vs = views_of(buf, SIZES)
    for i, v in enumerate(vs):
        v[:] = contribution(c.rank(), v.size, np.float32, seed=base_seed + i)
    before = shared_count(c)
    hs = [c.allreduce_async_(vs[i], op=rr.Sum, name=f"grad.{i}") for i in order]
    for h in hs:
        rr.synchronize(h)
    return [v.copy() for v in vs], shared_count(c) - before


def test_views_submitted_in_different_orders_fuse_and_run_shared():
    """The gradient pattern: views of one buffer, each rank submitting in its own order."""

    def body(c):
        buf = c.shared_zeros(sum(SIZES), np.float32)
        order = list(range(len(SIZES)))
        np.random.default_rng(c.rank()).shuffle(order)
        return [fused_step(c, buf, order, 10 * k) for k in range(3)]

    n = 2
    results = with_world(n, body, RINGREDUCE_BATCH_US=200_000)
    for k in range(3):
        for i, size in enumerate(SIZES):
            inputs = [contribution(r, size, np.float32, seed=10 * k + i) for r in range(n)]
            for r in range(n):
                got = results[r][k][0][i]
                assert got.tobytes() == results[0][k][0][i].tobytes()
                # two ranks: a + b is exact to the last bit whatever the path
                np.testing.assert_array_equal(got, (inputs[0] + inputs[1]).astype(np.float32))
        assert all(res[k][1] >= 1 for res in results), [res[k][1] for res in results]


def run_and_count(c, arr, name):
    arr[:] = c.rank() + 1
    before = shared_count(c)
    c.allreduce_(arr, op=rr.Sum, name=name)
    return arr.copy(), shared_count(c) - before


@pytest.mark.parametrize("case", ["layouts-differ", "one-rank-private", "small", "two-buffers",
                                  "below-threshold"])
def test_anything_else_takes_the_ring(case):
    """The ranks agree through the header: if any rank's data is elsewhere, all take the ring."""

    def body(c):
        buf = c.shared_zeros(COUNT + 1, np.float32)
        other = c.shared_zeros(COUNT, np.float32)
        if case == "layouts-differ":  # rank 1 reduces the same length one element further on
            return run_and_count(c, buf[c.rank() % 2:][:COUNT], case)
        if case == "one-rank-private":
            arr = buf[:COUNT] if c.rank() == 0 else np.zeros(COUNT, np.float32)
            return run_and_count(c, arr, case)
        if case == "small":  # the one-hop direct path stays the way for small tensors
            return run_and_count(c, buf[:100], case)
        if case == "below-threshold":  # RINGREDUCE_SHARED_MIN_BYTES=500000 (below: the ring)
            return run_and_count(c, buf[:COUNT], case)
        vs = [buf[:COUNT], other[:10_000]]  # a fused response across two buffers
        for v in vs:
            v[:] = c.rank() + 1
        before = shared_count(c)
        c.grouped_allreduce_async_(vs, op=rr.Sum, name=case).wait()
        return np.concatenate(vs), shared_count(c) - before

    threshold = 500_000 if case == "below-threshold" else 0
    for got, ran in with_world(2, body, RINGREDUCE_SHARED_MIN_BYTES=threshold):
        np.testing.assert_array_equal(got, 3)
        assert ran == 0


def test_the_threshold_is_a_lower_bound():
    def body(c):
        return run_and_count(c, c.shared_zeros(COUNT, np.float32), "at-threshold")

    for got, ran in with_world(2, body, RINGREDUCE_SHARED_MIN_BYTES=4 * COUNT):
        np.testing.assert_array_equal(got, 3)
        assert ran == 1


def test_size_mismatch_raises_on_every_rank_and_the_job_goes_on():
    def body(c):
        try:
            c.shared_zeros(100 + c.rank(), np.float32)
            raised = None
        except rr.MismatchError as err:
            raised = str(err)
        after = c.shared_zeros(COUNT, np.float32)
        return raised, run_and_count(c, after, "after")

    for raised, (got, ran) in with_world(2, body):
        assert raised is not None and "rank 0 400 bytes" in raised and "rank 1 404 bytes" in raised
        np.testing.assert_array_equal(got, 3)
        assert ran == 1


def shm_names() -> set:
    return {f for f in os.listdir("/dev/shm") if f.startswith("ringreduce-")}


def test_lifetime_zero_size_and_nothing_left_in_dev_shm():
    before = shm_names()

    def body(c):
        empty = c.shared_zeros((0, 4), np.int32)
        a = c.shared_zeros((300, 500), np.float64)
        shape_ok = (empty.shape == (0, 4) and a.shape == (300, 500) and a.dtype == np.float64
                    and a.flags.c_contiguous and a.flags.writeable and not a.any())
        view = a[100:]  # the view keeps the buffer alive after `a` goes
        del a
        gc.collect()
        got, ran = run_and_count(c, view, "view")
        del view
        gc.collect()
        b = c.shared_zeros(COUNT, np.float32)  # a new one after the first was released
        return shape_ok, got, ran, run_and_count(c, b, "new")

    results = with_world(2, body)
    for shape_ok, got, ran, (got2, ran2) in results:
        assert shape_ok
        np.testing.assert_array_equal(got, 3)
        np.testing.assert_array_equal(got2, 3)
        assert ran == 1 and ran2 == 1
    assert shm_names() <= before, shm_names() - before


def test_tcp_transport_gives_private_memory_and_the_ring():
    def body(c):
        a = c.shared_zeros(COUNT, np.float32)
        return run_and_count(c, a, "tcp")

    for got, ran in with_world(2, body, RINGREDUCE_TRANSPORT="tcp"):
        np.testing.assert_array_equal(got, 3)
        assert ran == 0


def test_joined_rank_supplies_zeros_through_the_ring():
    def body(c):
        buf = c.shared_zeros(COUNT, np.float32)
        if c.rank() == 1:
            return c.join(), None, 0
        buf[:] = 5
        before = shared_count(c)
        c.allreduce_(buf, op=rr.Average, name="uneven")
        ran = shared_count(c) - before
        return c.join(), buf.copy(), ran

    results = with_world(2, body)
    assert [j for j, _, _ in results] == [0, 0]
    np.testing.assert_array_equal(results[0][1], 5)  # Average over the one contributor
    assert results[0][2] == 0


def test_more_than_dev_shm_holds_is_a_clear_error():
    """tmpfs refuses a reservation larger than itself at once (no pages are touched)."""
    too_big = 2 * os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize

    def body(c):
        with pytest.raises(rr.InvalidInputError, match="/dev/shm is too small"):
            c.shared_zeros(too_big, np.uint8)
        return True

    assert with_world(2, body) == [True, True]


def test_object_dtype_is_refused():
    def body(c):
        with pytest.raises(rr.InvalidInputError, match="Python objects"):
            c.shared_zeros(3, object)
        return True

    assert with_world(2, body) == [True, True]


def test_use_after_shutdown_is_refused():
    w = make_world(2)
    for c in w:
        c.close()
    with pytest.raises(rr.RingReduceError, match="shut down"):
        w[0].shared_zeros(10)


def test_back_to_back_steps_never_see_a_peer_overwrite():
    """Each rank overwrites its buffer the moment its allreduce returns: the closing barrier
    must keep it from doing so while a peer still copies the result out of it."""

    def body(c):
        buf = c.shared_zeros(1 << 20, np.float32)
        wrong = 0
        for k in range(100):
            buf[:] = k * 10 + c.rank()
            c.allreduce_(buf, op=rr.Sum, name="step")
            wrong += int(np.count_nonzero(buf != 2 * k * 10 + 1))
        return wrong, shared_count(c)

    for wrong, ran in with_world(2, body):
        assert wrong == 0 and ran == 100
