"""Out-of-place allreduce (``allreduce(x)``) past the direct path: the ring reads the input
where it lies and writes only the output; the input must come back untouched, and the
result must equal the in-place one bit for bit, whatever the transport and slicing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import env

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

CONFIGS = {
    "shm": {},
    "shm-sliced": {"RINGREDUCE_SHM_SLOT_BYTES": "4096", "RINGREDUCE_SHM_SLOTS": "3",
                   "RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_RING_SLICE_BYTES": "12288"},
    "tcp": {"RINGREDUCE_TRANSPORT": "tcp"},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n", [2, 3])
def test_out_of_place_equals_in_place_and_keeps_the_input(n, config):
    with env(**CONFIGS[config]):
        comms = make_world(n)

    def fn(c):
        out = {}
        for count, dtype, op in [(100_003, np.float32, rr.Average), (70_001, np.int64, rr.Sum),
                                 (50_000, np.float64, rr.Max)]:
            x = (np.arange(count) % 97 + 7 * c.rank()).astype(dtype)
            keep = x.copy()
            got = c.allreduce(x, op=op, postscale_factor=1.0)
            assert np.array_equal(x, keep), "the input changed"
            c.allreduce_(x, op=op)
            assert got.tobytes() == x.tobytes(), f"{dtype} {op}: out of place != in place"
            out[(count, op)] = got
        return out

    results = run_threaded(n, fn, world=comms, timeout=60)
    for key, got in results[0].items():
        for other in results[1:]:
            assert other[key].tobytes() == got.tobytes()


def test_output_pool_reuses_only_dropped_results():
    from ringreduce._pool import OutputPool

    pool = OutputPool(capacity=4 << 20, min_bytes=1 << 16)
    a = pool.take(1 << 20)
    a[:] = 1
    view = a[10:20]  # a view keeps the block in use after the array itself is gone
    addr = a.ctypes.data
    del a
    b = pool.take(1 << 20)
    assert b.ctypes.data != addr and pool.reused == 0
    del view
    c = pool.take(1 << 20)
    assert c.ctypes.data == addr and pool.reused == 1
    assert c.ctypes.data % 64 == 0 and c.flags.writeable and c.nbytes == 1 << 20
    del b, c
    big = [pool.take(3 << 20) for _ in range(3)]  # more than the capacity comes back
    del big
    assert pool._kept <= 4 << 20
    small = pool.take(100)
    assert small.nbytes == 100 and small.ctypes.data % 64 == 0


def test_out_of_place_results_reuse_memory():
    def fn(c):
        x = np.ones(1 << 18, np.float32)  # 1 MiB
        for _ in range(4):
            y = c.allreduce(x, op=rr.Sum)
            assert (y == c.size()).all()
            del y
        return c._outputs.reused

    assert all(r >= 2 for r in run_threaded(2, fn, timeout=60))


def test_output_pool_block_stays_in_use_while_a_tensor_holds_it():
    torch = pytest.importorskip("torch")
    from ringreduce._pool import OutputPool

    pool = OutputPool(capacity=4 << 20, min_bytes=1 << 16)
    a = pool.take(1 << 20)
    t = torch.from_numpy(a)
    d = torch.from_dlpack(pool.take(1 << 20))
    addrs = {a.ctypes.data, d.data_ptr()}
    del a
    assert pool._kept == 0 and pool.take(1 << 20).ctypes.data not in addrs
    del t, d
    assert pool._kept > 0
