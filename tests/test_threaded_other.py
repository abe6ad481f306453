"""Threaded tier for allgather, broadcast, reducescatter, alltoall, barrier, objects."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import DTYPES, contribution, env
from test_threaded_collectives import CONFIGS

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

SIZES = [1, 2, 3, 4, 7]


def run(n, config, fn):
    with env(**CONFIGS[config]):
        comms = make_world(n)
    try:
        return run_threaded(n, fn, world=comms)
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", SIZES)
def test_allgather_variable_first_dim(n, config):
    def rows(r):
        return (3 * r + 1) % 5  # includes ranks with zero rows

    def body(c):
        out = {}
        for dtype in DTYPES:
            x = contribution(c.rank(), rows(c.rank()) * 6, dtype).reshape(-1, 2, 3)
            out[np.dtype(dtype).name] = c.allgather(x)
        out["big"] = c.allgather(np.full((5000 * (c.rank() + 1),), c.rank(), np.float64))
        return out

    res = run(n, config, body)
    for dtype in DTYPES:
        want = np.concatenate([contribution(r, rows(r) * 6, dtype).reshape(-1, 2, 3)
                               for r in range(n)])
        for r in range(n):
            got = res[r][np.dtype(dtype).name]
            assert got.dtype == np.dtype(dtype) and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
    want_big = np.concatenate([np.full(5000 * (r + 1), r, np.float64) for r in range(n)])
    assert all((res[r]["big"] == want_big).all() for r in range(n))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", SIZES)
def test_broadcast_every_root(n, config):
    counts = [0, 1, 7, 100_003]

    def body(c):
        out = []
        for root in range(n):
            for count in counts:
                x = contribution(c.rank(), count, np.float32, seed=root)
                c.broadcast_(x, root_rank=root)
                out.append(x)
            out.append(c.broadcast(np.int64(c.rank() * 10), root_rank=root))  # 0-d
        return out

    res = run(n, config, body)
    k = 0
    for root in range(n):
        for count in counts:
            want = contribution(root, count, np.float32, seed=root)
            assert all(res[r][k].tobytes() == want.tobytes() for r in range(n))
            k += 1
        assert all(res[r][k] == root * 10 and res[r][k].shape == () for r in range(n))
        k += 1


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", SIZES)
def test_reducescatter(n, config):
    rows = 2 * n + 1  # not divisible by n: lower ranks get one more row

    def body(c):
        x = contribution(c.rank(), rows * 3, np.int32).reshape(rows, 3)
        return c.reducescatter(x, op=rr.Sum), c.reducescatter(x.astype(np.float64),
                                                               op=rr.Average)

    res = run(n, config, body)
    total = sum(contribution(r, rows * 3, np.int32).reshape(rows, 3).astype(np.int64)
                for r in range(n))
    start = 0
    for r in range(n):
        mine = rows // n + (r < rows % n)
        np.testing.assert_array_equal(res[r][0], total[start:start + mine])
        np.testing.assert_allclose(res[r][1], total[start:start + mine] / n)
        start += mine


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", SIZES)
def test_alltoall_uneven_splits(n, config):
    def splits_of(r):
        return [(r + d) % 3 for d in range(n)]

    def data_of(r):
        return np.arange(sum(splits_of(r)) * 2, dtype=np.int64).reshape(-1, 2) + 1000 * r

    def body(c):
        out, received = c.alltoall(data_of(c.rank()), splits=splits_of(c.rank()))
        even = c.alltoall(np.full(n * 2, c.rank(), np.float32))
        return out, received, even

    res = run(n, config, body)
    for r in range(n):
        parts = []
        for src in range(n):
            off = sum(splits_of(src)[:r])
            parts.append(data_of(src)[off:off + splits_of(src)[r]])
        np.testing.assert_array_equal(res[r][0], np.concatenate(parts))
        assert list(res[r][1]) == [splits_of(src)[r] for src in range(n)]
        np.testing.assert_array_equal(res[r][2], np.repeat(np.arange(n, dtype=np.float32), 2))


def test_barrier_waits_for_everyone():
    entered = []
    lock = threading.Lock()

    def body(c):
        if c.rank() == 2:
            time.sleep(0.3)
        with lock:
            entered.append(c.rank())
        c.barrier()
        with lock:
            return sorted(entered)

    assert all(r == [0, 1, 2] for r in run_threaded(3, body))


def test_objects():
    def body(c):
        b = c.broadcast_object({"epoch": 3, "rank": c.rank()}, root_rank=1)
        g = c.allgather_object(("r", c.rank(), "x" * c.rank() * 1000))
        return b, g

    for b, g in run_threaded(3, body):
        assert b == {"epoch": 3, "rank": 1}
        assert g == [("r", r, "x" * r * 1000) for r in range(3)]


def test_inputs_through_dlpack_and_buffer_protocol():
    def body(c):
        a = c.allreduce(memoryview(np.ones(4, np.float32)), op=rr.Sum)
        b = c.allreduce(bytearray(b"\x01\x02"), op=rr.Max)
        d = c.allreduce(np.arange(6.0).reshape(2, 3)[:, ::2], op=rr.Sum)  # strided input
        return a, b, d

    for a, b, d in run_threaded(2, body):
        assert (a == 2).all() and list(b) == [1, 2]
        np.testing.assert_array_equal(d, 2 * np.arange(6.0).reshape(2, 3)[:, ::2])
