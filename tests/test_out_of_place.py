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


def test_blocking_calls_on_plain_arrays_take_one_call_and_agree_with_the_general_path():
    """Blocking allreduce / allreduce_ of a plain numpy array are checked, submitted and
    waited for in one C++ call (Engine.allreduce_array_now); results must equal the
    asynchronous (general) path's bit for bit, small results be new 64-byte-aligned
    arrays, read-only and 0-d inputs work, and what the fast path cannot take (a
    non-contiguous array, a list, a result the output pool serves) still works."""
    comms = make_world(2)
    pool_min = comms[0]._outputs.min_bytes

    def fn(c):
        r, cases = c.rank(), []
        for dtype in (np.float32, np.float64, np.int32, np.uint8, np.float16, np.bool_):
            for shape in ((), (0,), (5,), (3, 4)):
                x = np.asarray(np.arange(int(np.prod(shape))).reshape(shape) % 3 + r, dtype)
                op = rr.Max if dtype is np.bool_ else rr.Sum
                fast = c.allreduce(x, op=op, name=f"f{np.dtype(dtype).name}{len(shape)}")
                slow = c.allreduce_async(x, op=op).wait()
                assert fast.tobytes() == slow.tobytes() and fast.shape == slow.shape
                assert fast.dtype == x.dtype and fast.flags.c_contiguous
                assert fast.ctypes.data % 64 == 0 or fast.size == 0
                y = x.copy()
                assert c.allreduce_(y, op=op) is y and y.tobytes() == slow.tobytes()
                cases.append(fast)
        with pytest.raises(rr.InvalidInputError, match="immutable float32"):
            c.allreduce_(np.float32(r), op=rr.Sum, name="refused")  # nothing to write into
        cases.append(c.allreduce(np.float32(r), op=rr.Sum, name="scalar"))
        ro = np.full(4, r + 1.0)
        ro.flags.writeable = False
        cases.append(c.allreduce(ro, op=rr.Sum))
        cases.append(c.allreduce(np.arange(8.0)[::2] + r, op=rr.Sum))  # non-contiguous
        cases.append(c.allreduce(memoryview(np.array([1.0 + r, 2.0])), op=rr.Sum))  # a buffer
        big = c.allreduce(np.ones(pool_min // 4, np.float32), op=rr.Sum)  # the pool's
        return cases, big

    res = run_threaded(2, fn, world=comms)
    for c in comms:
        c.close()
    (a, big), (b, _) = res
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
    assert a[-4].tolist() == 1.0
    assert a[-3].tolist() == [3.0] * 4 and a[-2].tolist() == [1, 5, 9, 13]
    assert a[-1].tolist() == [3.0, 4.0] and (big == 2).all()
