"""GPU collectives end to end on emulated GPUs (RINGREDUCE_GPU_EMULATE=1): "device memory"
is host memory, so small classes that expose host buffers as CUDA arrays (DLPack kDLCUDA,
or __cuda_array_interface__) go through the real intake, engine, GPU executor (plans,
fusion buffer, pack/unpack, scaling) and NCCL bootstrap, with ringreduce's CPU collectives
standing in for NCCL. Rank r's arrays are on "GPU r", as with one GPU per process.
Checks every result against numpy and logs ``OK rank <r>``.

    RINGREDUCE_GPU_EMULATE=1 python gpu_emulated_worker.py
"""

from __future__ import annotations

import numpy as np
from workerlib import run, say, set_rank

import ringreduce as rr

KDL_CUDA = 2


class DlpackGpu:
    """A host buffer that says it is on CUDA device ``device`` (DLPack)."""

    def __init__(self, a: np.ndarray, device: int) -> None:
        self.a, self.device, self.streams = a, device, []

    def __dlpack_device__(self):
        return (KDL_CUDA, self.device)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.a.__dlpack__()


class CaiGpu:
    """A host buffer behind __cuda_array_interface__ v3, produced on stream 7."""

    def __init__(self, a: np.ndarray, strides=None) -> None:
        self.a = a
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
            "version": 3, "strides": strides, "stream": 7}


def inputs(rank: int, n: int, dtype) -> np.ndarray:
    return ((np.arange(n) % 7) + rank + 1).astype(dtype)


def check_allreduce(rank: int, size: int) -> None:
    reduce = {rr.Sum: np.sum, rr.Min: np.min, rr.Max: np.max, rr.Product: np.prod}
    for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8):
        for op, fn in reduce.items():
            x = DlpackGpu(inputs(rank, 13, dtype), rank)
            got = rr.allreduce_(x, op=op, name=f"ar.{np.dtype(dtype).name}.{op}")
            want = fn(np.stack([inputs(r, 13, dtype) for r in range(size)]), axis=0)
            assert got is x and np.array_equal(x.a, want.astype(dtype)), (dtype, op, x.a, want)
            assert x.streams == [1], x.streams  # asked to order its work before stream 1
    x = DlpackGpu(inputs(rank, 1000, np.float32), rank)
    rr.allreduce_(x, op=rr.Average, prescale_factor=2.0, postscale_factor=0.5, name="avg")
    want = np.mean([inputs(r, 1000, np.float32) for r in range(size)], axis=0)
    np.testing.assert_allclose(x.a, want, rtol=1e-6)


def check_out_of_place_and_fused(rank: int, size: int) -> None:
    src = CaiGpu(inputs(rank, 10, np.float32))
    before = src.a.copy()
    out = rr.allreduce(src, op=rr.Sum, name="oop", prescale_factor=3.0)
    assert isinstance(out, CaiGpu) and np.array_equal(src.a, before)  # input untouched
    np.testing.assert_array_equal(out.a, 3 * sum(inputs(r, 10, np.float32)
                                                 for r in range(size)))
    # Many async allreduces before any wait: fused by the engine (pack, NCCL, unpack).
    xs = [DlpackGpu(inputs(rank, 5 + i, np.float32), rank) for i in range(8)]
    hs = [rr.allreduce_async_(x, op=rr.Sum, name=f"fuse.{i}") for i, x in enumerate(xs)]
    for i, (x, h) in enumerate(zip(xs, hs)):
        assert rr.synchronize(h) is x
        np.testing.assert_array_equal(x.a, sum(inputs(r, 5 + i, np.float32)
                                               for r in range(size)))
    group = [DlpackGpu(inputs(rank, n, np.float64), rank) for n in (3, 0, 70)]
    outs = rr.grouped_allreduce(group, op=rr.Average)
    for g, o in zip(group, outs):
        assert isinstance(o, DlpackGpu) and o.device == rank
        np.testing.assert_allclose(o.a, np.mean([inputs(r, g.a.size, np.float64)
                                                 for r in range(size)], axis=0))


def check_broadcast(rank: int, size: int) -> None:
    root = size - 1
    x = DlpackGpu(inputs(rank, 9, np.int64), rank)
    assert rr.broadcast_(x, root_rank=root, name="b_") is x
    np.testing.assert_array_equal(x.a, inputs(root, 9, np.int64))
    src = DlpackGpu(inputs(rank, 4, np.float32), rank)
    out = rr.broadcast(src, root_rank=0, name="b")
    np.testing.assert_array_equal(out.a, inputs(0, 4, np.float32))
    np.testing.assert_array_equal(src.a, inputs(rank, 4, np.float32))


def check_refusals(rank: int) -> None:
    def refused(fn, match: str) -> None:
        try:
            fn()
        except rr.InvalidInputError as e:
            assert match in str(e), str(e)
            return
        raise AssertionError(f"not refused: {match}")

    refused(lambda: rr.allreduce_(DlpackGpu(np.zeros(2, np.float32), rank + 5), name="w"),
            f"on CUDA device {rank + 5}, but this rank's GPU collectives run on device {rank}")
    strided = np.zeros((4, 4), np.float32)
    refused(lambda: rr.allreduce_(CaiGpu(strided, strides=(4, 16)), name="s"),
            "need a C-contiguous array, got strides (4, 16)")
    refused(lambda: rr.allreduce(CaiGpu(np.zeros(2, np.complex64)), name="c"),
            "dtype complex64 is not supported")
    refused(lambda: rr.allgather(DlpackGpu(np.zeros(2, np.float32), rank), name="g"),
            "on GPU, ringreduce runs allreduce, grouped_allreduce and broadcast so far")


def main() -> None:
    rr.init()
    rank, size = rr.rank(), rr.size()
    set_rank(rank)
    rr.register_gpu_array_type(DlpackGpu, lambda x: DlpackGpu(np.empty_like(x.a), x.device))
    rr.register_gpu_array_type(CaiGpu, lambda x: CaiGpu(np.empty_like(x.a)))
    check_allreduce(rank, size)
    check_out_of_place_and_fused(rank, size)
    check_broadcast(rank, size)
    check_refusals(rank)
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
