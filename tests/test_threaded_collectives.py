"""Threaded tier: N ranks as threads in one process, over real shm and TCP links.

Each world runs every (dtype, op, count) combination inside one threaded call,
so the sweep costs one world setup per configuration.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, OPS, contribution, env, reference, tolerance

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

# Small slots and no direct path force multi-chunk rings on small arrays.
CONFIGS = {
    "shm": {},
    "shm-small-slots": {"RINGREDUCE_SHM_SLOT_BYTES": "4096", "RINGREDUCE_SHM_SLOTS": "2",
                        "RINGREDUCE_SMALL_BYTES": "0"},
    "shm-streaming-stores": {"RINGREDUCE_SHM_SLOT_BYTES": "4096", "RINGREDUCE_SMALL_BYTES": "0",
                             "RINGREDUCE_SHM_STREAM_SEND_BYTES": "4096",
                             "RINGREDUCE_STREAMING_BYTES": "0"},
    # Rings larger than a slice run slice by slice (ring_pipeline.h); an odd
    # slice of three slots leaves uneven last pieces.
    "shm-sliced": {"RINGREDUCE_SHM_SLOT_BYTES": "4096", "RINGREDUCE_SHM_SLOTS": "4",
                   "RINGREDUCE_RING_SLICE_BYTES": "12288", "RINGREDUCE_SMALL_BYTES": "0"},
    "tcp-small-chunks": {"RINGREDUCE_TRANSPORT": "tcp", "RINGREDUCE_SHM_SLOT_BYTES": "4096",
                         "RINGREDUCE_SMALL_BYTES": "0"},
}


def counts_for(n: int) -> list:
    return [0, 1, 7, 5 * n + 3, 3 * 4096 * n // 4 + 5]


def supported(dtype, op) -> bool:
    return not (np.dtype(dtype) == np.bool_ and op == rr.Average)


def world(n: int, config: str, host_ids=None):
    with env(**CONFIGS[config]):
        return make_world(n, host_ids)


def sweep(comm, n):
    """All allreduce combinations on one rank; returns {key: result}."""
    out = {}
    for count in counts_for(n):
        for dtype in DTYPES:
            for op in OPS:
                if supported(dtype, op):
                    x = contribution(comm.rank(), count, dtype, seed=count)
                    out[(count, np.dtype(dtype).name, op)] = comm.allreduce(x, op=op)
    return out


def check_sweep(results: list, n: int):
    for key, got0 in results[0].items():
        count, dname, op = key
        dtype = next(d for d in DTYPES if np.dtype(d).name == dname)
        inputs = [contribution(r, count, dtype, seed=count) for r in range(n)]
        want = reference(inputs, op, dtype)
        for r in range(n):
            assert results[r][key].tobytes() == got0.tobytes(), f"{key}: rank {r} differs"
        assert got0.dtype == np.dtype(dtype) and got0.shape == (count,)
        tol = tolerance(dtype, op, n)
        np.testing.assert_allclose(got0.astype(np.float64), want, rtol=tol, atol=tol,
                                   err_msg=str(key))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", range(1, 9))
def test_allreduce_sweep(n, config):
    comms = world(n, config)
    try:
        check_sweep(run_threaded(n, lambda c: sweep(c, n), world=comms), n)
    finally:
        for c in comms:
            c.close()


def test_allreduce_mixed_hosts():
    """Ranks on two fake hosts: shm inside a host, TCP across."""
    comms = world(4, "shm", host_ids=["a", "a", "b", "b"])
    try:
        assert comms[0].transport_to(1) == "shm" and comms[0].transport_to(2) == "tcp"
        assert [c.local_rank() for c in comms] == [0, 1, 0, 1]
        assert [c.cross_rank() for c in comms] == [0, 0, 1, 1]
        assert comms[0].cross_size() == 2 and comms[3].local_size() == 2
        check_sweep(run_threaded(4, lambda c: sweep(c, 4), world=comms), 4)
    finally:
        for c in comms:
            c.close()


def test_large_allreduce_repeatable():
    """Multi-segment ring on the default transport; repeated runs give the same bits."""
    count = 3 * (256 << 10) + 17

    def body(c):
        x = contribution(c.rank(), count, np.float32, seed=1)
        return [c.allreduce(x, op=rr.Sum) for _ in range(3)]

    res = run_threaded(3, body)
    first = res[0][0].tobytes()
    assert all(r.tobytes() == first for per_rank in res for r in per_rank)
    want = reference([contribution(r, count, np.float32, seed=1) for r in range(3)], rr.Sum,
                     np.float32)
    np.testing.assert_allclose(res[0][0], want, rtol=1e-6)


def test_scaling_factors_and_inplace():
    def body(c):
        x = np.full(1000, c.rank() + 1.0, np.float32)
        y = c.allreduce(x, op=rr.Sum, prescale_factor=2.0, postscale_factor=0.5)
        z = np.arange(6, dtype=np.int32) * (c.rank() + 1)
        c.allreduce_(z, op=rr.Average)
        return y, z

    for (y, z) in run_threaded(3, body):
        assert (y == 6.0).all()
        assert (z == np.arange(6) * 2).all()
