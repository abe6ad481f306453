"""GPU collectives end to end, every result checked against numpy; logs ``OK rank <r>``.

``--arrays emulated`` (with RINGREDUCE_GPU_EMULATE=1, no GPU needed): "device memory" is
host memory, so small classes that expose host buffers as CUDA arrays (DLPack kDLCUDA, or
__cuda_array_interface__) go through the real intake, engine, GPU executor (plans, fusion
buffer, pack/unpack, scaling) and NCCL bootstrap, with ringreduce's CPU collectives
standing in for NCCL. Rank r's arrays are on "GPU r", as with one GPU per process.
``--arrays cupy`` / ``--arrays torch`` (tests/gpu/, a real GPU per rank): the same checks on
CuPy arrays or torch CUDA tensors on GPU ``local_rank`` (mod the GPUs there are).

    RINGREDUCE_GPU_EMULATE=1 python gpu_worker.py --arrays emulated
"""

from __future__ import annotations

import argparse
import os

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


class Arrays:
    """Makes GPU arrays of one kind from numpy arrays and reads them back."""

    def __init__(self, kind: str, rank: int) -> None:
        self.kind, self.rank = kind, rank
        if kind == "cupy":
            import cupy

            cupy.cuda.Device(rr.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
            self.xp = cupy
        elif kind == "torch":
            import torch

            torch.cuda.set_device(rr.local_rank() % torch.cuda.device_count())
            self.xp = torch

    def make(self, a: np.ndarray, cai: bool = False):
        if self.kind == "cupy":
            return self.xp.asarray(a)
        if self.kind == "torch":
            return self.xp.from_numpy(a).cuda()
        return CaiGpu(a) if cai else DlpackGpu(a, self.rank)

    def host(self, x) -> np.ndarray:
        if self.kind == "cupy":
            return x.get()
        if self.kind == "torch":
            return x.cpu().numpy()
        return x.a


def inputs(rank: int, n: int, dtype) -> np.ndarray:
    return ((np.arange(n) % 7) + rank + 1).astype(dtype)


def check_allreduce(g: Arrays, rank: int, size: int) -> None:
    reduce = {rr.Sum: np.sum, rr.Min: np.min, rr.Max: np.max, rr.Product: np.prod}
    for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8):
        for op, fn in reduce.items():
            x = g.make(inputs(rank, 13, dtype))
            got = rr.allreduce_(x, op=op, name=f"ar.{np.dtype(dtype).name}.{op}")
            want = fn(np.stack([inputs(r, 13, dtype) for r in range(size)]), axis=0)
            assert got is x and np.array_equal(g.host(x), want.astype(dtype)), (dtype, op, want)
            if g.kind == "emulated":  # asked to order its work before stream 1
                assert x.streams == [1], x.streams
    x = g.make(inputs(rank, 1000, np.float32))
    rr.allreduce_(x, op=rr.Average, prescale_factor=2.0, postscale_factor=0.5, name="avg")
    want = np.mean([inputs(r, 1000, np.float32) for r in range(size)], axis=0)
    np.testing.assert_allclose(g.host(x), want, rtol=1e-6)


def check_described_allreduce(g: Arrays, rank: int, size: int) -> None:
    """Communicator.allreduce_gpu_view_, DistributedOptimizer's per-gradient CUDA path: the
    caller describes each array; several in flight (fused), scales, an fp16 wire, and an
    array on another device refused before anything is submitted."""
    from ringreduce._cuda_arrays import cuda_view
    from ringreduce._gpu_collectives import wait_on_stream

    c = rr._comm()

    def start(x, name, op=rr.Sum, pre=1.0, post=1.0, compression=None):
        v = cuda_view(x, "allreduce_", name)
        return c.allreduce_gpu_view_(x, v.ptr, v.shape, v.code, v.device, v.stream, op, name,
                                     pre, post, compression)

    xs = [g.make(inputs(rank, 3 + 40 * i, np.float32)) for i in range(6)]
    hs = [start(x, f"view.{i}", pre=2.0, post=0.5) for i, x in enumerate(xs)]
    for i, (x, h) in enumerate(zip(xs, hs)):
        # half stream-ordered (DistributedOptimizer's wait): the default stream (0), on
        # which host() reads, waits for the allreduce (None: it was done already)
        if i % 2:
            used = wait_on_stream(h, 0)
            assert used is None or isinstance(used, int), used
        else:
            assert h.wait() is x
        want = sum(inputs(r, 3 + 40 * i, np.float32) for r in range(size))
        np.testing.assert_allclose(g.host(x), want, rtol=1e-6)
    x = g.make(np.full(5, 1 + 2.0 ** -12, np.float32))  # 1.0 in float16
    start(x, "view.fp16", compression="fp16").wait()
    np.testing.assert_array_equal(g.host(x), np.full(5, size, np.float32))
    v = cuda_view(x, "allreduce_", "view.other")
    try:
        c.allreduce_gpu_view_(x, v.ptr, v.shape, v.code, v.device + 1, v.stream, rr.Sum,
                              "view.other", 1.0, 1.0, None)
    except rr.InvalidInputError as err:
        assert f"on CUDA device {v.device + 1}" in str(err), err
    else:
        raise AssertionError("an array on another device was not refused")


def check_out_of_place_and_fused(g: Arrays, rank: int, size: int) -> None:
    src = g.make(inputs(rank, 10, np.float32), cai=True)
    before = g.host(src).copy()
    out = rr.allreduce(src, op=rr.Sum, name="oop", prescale_factor=3.0)
    assert type(out) is type(src) and np.array_equal(g.host(src), before)  # input untouched
    np.testing.assert_array_equal(g.host(out), 3 * sum(inputs(r, 10, np.float32)
                                                       for r in range(size)))
    # Many async allreduces before any wait: fused by the engine (pack, NCCL, unpack).
    xs = [g.make(inputs(rank, 5 + i, np.float32)) for i in range(8)]
    hs = [rr.allreduce_async_(x, op=rr.Sum, name=f"fuse.{i}") for i, x in enumerate(xs)]
    for i, (x, h) in enumerate(zip(xs, hs)):
        assert rr.synchronize(h) is x
        np.testing.assert_array_equal(g.host(x), sum(inputs(r, 5 + i, np.float32)
                                                     for r in range(size)))
    sizes = (3, 0, 70)
    group = [g.make(inputs(rank, n, np.float64)) for n in sizes]
    outs = rr.grouped_allreduce(group, op=rr.Average)
    for n, o in zip(sizes, outs):
        assert type(o) is type(group[0])
        np.testing.assert_allclose(g.host(o), np.mean([inputs(r, n, np.float64)
                                                       for r in range(size)], axis=0))


def check_broadcast(g: Arrays, rank: int, size: int) -> None:
    root = size - 1
    x = g.make(inputs(rank, 9, np.int64))
    assert rr.broadcast_(x, root_rank=root, name="b_") is x
    np.testing.assert_array_equal(g.host(x), inputs(root, 9, np.int64))
    src = g.make(inputs(rank, 4, np.float32))
    out = rr.broadcast(src, root_rank=0, name="b")
    np.testing.assert_array_equal(g.host(out), inputs(0, 4, np.float32))
    np.testing.assert_array_equal(g.host(src), inputs(rank, 4, np.float32))


def check_reducescatter(g: Arrays, rank: int, size: int) -> None:
    # Rows not divisible by the ranks (padded blocks) and divisible ones (one NCCL call).
    for rows in (2 * size + 1, 2 * size):
        for op, cai in ((rr.Sum, False), (rr.Average, True)):
            x = g.make(inputs(rank, rows * 3, np.float64).reshape(rows, 3), cai=cai)
            out = rr.reducescatter(x, op=op, name=f"rs.{rows}.{op}", prescale_factor=2.0)
            total = sum(inputs(r, rows * 3, np.float64) for r in range(size)).reshape(rows, 3)
            total = 2 * total / (size if op == rr.Average else 1)
            first = rank * (rows // size) + min(rank, rows % size)
            mine = rows // size + (rank < rows % size)
            assert type(out) is type(x)
            np.testing.assert_allclose(g.host(out), total[first:first + mine], rtol=1e-12)
            np.testing.assert_array_equal(g.host(x).reshape(-1),
                                          inputs(rank, rows * 3, np.float64))


def check_allgather(g: Arrays, rank: int, size: int) -> None:
    # Equal row counts (one NCCL allgather) and ragged ones (padded, then compacted), of
    # several dtypes; a rank with no rows; the grouped and async forms.
    for rows_of, dtype in ((lambda r: 3, np.float32), (lambda r: r + 1, np.int64),
                           (lambda r: 2 * r, np.float16)):
        x = g.make(inputs(rank, rows_of(rank) * 5, dtype).reshape(-1, 5))
        out = rr.allgather(x, name=f"ag.{np.dtype(dtype).name}")
        want = np.concatenate([inputs(r, rows_of(r) * 5, dtype).reshape(-1, 5)
                               for r in range(size)])
        assert type(out) is type(x) and np.array_equal(g.host(out), want), (dtype, want)
    xs = [g.make(inputs(rank, (rank + 1) * (i + 1), np.float64)) for i in range(3)]
    outs = rr.grouped_allgather(xs)
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(g.host(o), np.concatenate(
            [inputs(r, (r + 1) * (i + 1), np.float64) for r in range(size)]))
    h = rr.allgather_async(g.make(inputs(rank, 4, np.int32)))
    np.testing.assert_array_equal(g.host(rr.synchronize(h)),
                                  np.concatenate([inputs(r, 4, np.int32) for r in range(size)]))


def check_alltoall(g: Arrays, rank: int, size: int) -> None:
    x = g.make(inputs(rank, 2 * size * 3, np.float32).reshape(2 * size, 3))
    out = rr.alltoall(x, name="a2a")
    want = np.concatenate([inputs(r, 2 * size * 3, np.float32).reshape(2 * size, 3)
                           [2 * rank:2 * rank + 2] for r in range(size)])
    assert type(out) is type(x) and np.array_equal(g.host(out), want)
    # Ragged splits, a zero among them: rank r sends q + r rows to rank q (none to itself
    # when q + r == 0).
    def splits(r):
        return [q + r for q in range(size)]

    def data(r):
        return inputs(r, sum(splits(r)) * 2, np.int64).reshape(-1, 2)

    out, received = rr.alltoall(g.make(data(rank)), splits=splits(rank), name="a2a.ragged")
    starts = [np.cumsum([0] + splits(r)) for r in range(size)]
    want = np.concatenate([data(r)[starts[r][rank]:starts[r][rank + 1]] for r in range(size)])
    np.testing.assert_array_equal(received, [splits(r)[rank] for r in range(size)])
    np.testing.assert_array_equal(g.host(out), want)


def check_compression_emulated(rank: int, size: int) -> None:
    """ringreduce.compression's CastCompressor (what Compression.fp16 is in every framework)
    over GPU arrays: the float16 array it hands over is reduced on the GPU path."""
    from ringreduce.compression import CastCompressor

    class Fp16(CastCompressor):
        wire = np.dtype(np.float16)
        dtype_of = staticmethod(lambda x: x.a.dtype)
        is_float = staticmethod(lambda d: d.kind == "f")
        itemsize = staticmethod(lambda d: np.dtype(d).itemsize)
        cast = staticmethod(lambda x, d: DlpackGpu(x.a.astype(d), x.device))

    x = DlpackGpu(inputs(rank, 40, np.float32) / 4, rank)
    sent, ctx = Fp16.compress(x)
    assert isinstance(sent, DlpackGpu) and sent.a.dtype == np.float16
    out = Fp16.decompress(rr.allreduce(sent, op=rr.Average, name="fp16"), ctx)
    assert out.a.dtype == np.float32
    np.testing.assert_allclose(out.a, np.mean([inputs(r, 40, np.float32) / 4
                                               for r in range(size)], axis=0), rtol=1e-3)


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, rounding to nearest even (numpy has no bfloat16)."""
    u = a.astype(np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def lossy(rank: int, n: int) -> np.ndarray:
    """k / 8 + rank + 1 (exact in float16 / bfloat16, and so are sums of 3 of them) plus
    2^-12, which rounding to either wire dtype drops: compression changes the result."""
    return ((np.arange(n) % 7) / 8 + rank + 1 + 2.0 ** -12).astype(np.float32)


def to_wire(a: np.ndarray, wire: str) -> np.ndarray:
    return a.astype(np.float16).astype(a.dtype) if wire == "fp16" else round_bf16(a)


def check_executor_compression(g: Arrays, rank: int, size: int) -> None:
    """compression='fp16' / 'bf16': float32 arrays cast by the GPU executor's pack kernel
    into a half-precision fusion buffer, reduced in that dtype, cast back by the unpack;
    each result equals reducing the rounded inputs in the wire dtype (exact sums here),
    cast back, bit for bit, and differs from the float32 reduction."""
    ranks = range(size)
    for wire in ("fp16", "bf16"):
        x = g.make(lossy(rank, 40))
        assert rr.allreduce_(x, op=rr.Sum, name=f"cz.{wire}", compression=wire) is x
        want = sum(to_wire(lossy(r, 40), wire) for r in ranks)
        np.testing.assert_array_equal(g.host(x), want)
        assert not np.array_equal(want, sum(lossy(r, 40) for r in ranks))
        # Fused (async, several sizes), prescale folded into the pack (one rounding of x * 0.5),
        # Average's 1 / size and the postscale folded into the unpack, in float32.
        xs = [g.make(lossy(rank, n)) for n in (3, 1000, 17)]
        hs = [rr.allreduce_async(x, op=rr.Average, name=f"cz.{wire}.{i}", prescale_factor=0.5,
                                 postscale_factor=3.0, compression=wire)
              for i, x in enumerate(xs)]
        for n, h in zip((3, 1000, 17), hs):
            wsum = sum(to_wire(lossy(r, n) * np.float32(0.5), wire) for r in ranks)
            np.testing.assert_array_equal(g.host(rr.synchronize(h)),
                                          wsum * np.float32(3.0 / size))
    # float64 arrays travel as float16 too; other dtypes travel as they are.
    d = g.make(lossy(rank, 9).astype(np.float64))
    rr.allreduce_(d, op=rr.Max, name="cz.f64", compression="fp16")
    want = np.max([to_wire(lossy(r, 9), "fp16") for r in ranks], axis=0).astype(np.float64)
    np.testing.assert_array_equal(g.host(d), want)
    i = g.make(inputs(rank, 5, np.int32))
    rr.allreduce_(i, op=rr.Sum, name="cz.i32", compression="bf16")
    np.testing.assert_array_equal(g.host(i), sum(inputs(r, 5, np.int32) for r in ranks))
    out = rr.grouped_allreduce([g.make(lossy(rank, n)) for n in (2, 6)], op=rr.Sum,
                               compression="bf16")
    for n, o in zip((2, 6), out):
        np.testing.assert_array_equal(g.host(o), sum(round_bf16(lossy(r, n)) for r in ranks))
    if size > 1:  # ranks must agree on the compression: a MismatchError on every rank
        try:
            rr.allreduce(g.make(lossy(rank, 4)), name="cz.mismatch",
                         compression="fp16" if rank == 0 else None)
        except rr.MismatchError as e:
            assert "compression=float16" in str(e), str(e)
        else:
            raise AssertionError("a compression mismatch was not refused")


def check_torch_low_precision(rank: int, size: int) -> None:
    """torch only (real GPUs): float16 / bfloat16 CUDA tensors reduced by NCCL,
    ringreduce.torch's Compression.fp16 / .bf16 casting on the device (torch ops), never
    through host memory, and the torch layer's allgather / alltoall on CUDA tensors."""
    import torch

    import ringreduce.torch as rrt

    base = torch.arange(64, dtype=torch.float64) / 8
    want = sum(base + r for r in range(size)) / size
    for dtype in (torch.float16, torch.bfloat16):
        x = (base + rank).to(dtype).cuda()
        out = rrt.allreduce(x, op=rrt.Average, name=f"lp.{dtype}")
        assert out.is_cuda and out.dtype == dtype
        torch.testing.assert_close(out.double().cpu(), want, rtol=1e-2, atol=1e-2)
    for comp, wire in ((rrt.Compression.fp16, torch.float16),
                       (rrt.Compression.bf16, torch.bfloat16)):
        x = (base + rank).float().cuda()
        sent, ctx = comp.compress(x)
        assert sent.is_cuda and sent.dtype == wire  # cast on the device
        out = rrt.allreduce(x, op=rrt.Average, compression=comp, name=f"comp.{wire}")
        assert out.is_cuda and out.dtype == torch.float32
        torch.testing.assert_close(out.double().cpu(), want, rtol=1e-2, atol=1e-2)
    # The torch layer hands float32 CUDA tensors to the GPU executor's casting kernels:
    # bit for bit the reduction of the rounded inputs, also grouped and as the optimizer does.
    for comp, name in ((rrt.Compression.fp16, "fp16"), (rrt.Compression.bf16, "bf16")):
        ranks = range(size)
        x = torch.from_numpy(lossy(rank, 40)).cuda()
        out = rrt.allreduce(x, op=rrt.Sum, compression=comp, name=f"comp.exact.{name}")
        np.testing.assert_array_equal(out.cpu().numpy(),
                                      sum(to_wire(lossy(r, 40), name) for r in ranks))
        outs = rrt.grouped_allreduce([torch.from_numpy(lossy(rank, n)).cuda() for n in (3, 9)],
                                     op=rrt.Sum, compression=comp, name=f"comp.group.{name}")
        for n, o in zip((3, 9), outs):
            assert o.is_cuda and o.dtype == torch.float32
            np.testing.assert_array_equal(o.cpu().numpy(),
                                          sum(to_wire(lossy(r, n), name) for r in ranks))
    # The torch layer's allgather / alltoall on CUDA tensors (ragged rows, splits).
    got = rrt.allgather(torch.full((rank + 1, 2), float(rank), device="cuda"), name="t.ag")
    assert got.is_cuda and got.cpu().tolist() == [[float(r)] * 2 for r in range(size)
                                                 for _ in range(r + 1)]
    out, received = rrt.alltoall(torch.arange(size, device="cuda") + 10 * rank,
                                 splits=[1] * size, name="t.a2a")
    assert out.is_cuda and out.cpu().tolist() == [10 * r + rank for r in range(size)]
    assert received.tolist() == [1] * size


def check_process_sets(g: Arrays, rank: int, pair, solo) -> None:
    """Collectives of a set on GPU run on an NCCL communicator of its members (made at
    the set's first GPU collective, before the job's here); ranks are the set's."""
    if pair.included():
        ms, me = pair.ranks, pair.rank()
        x = g.make(inputs(rank, 6, np.float32))
        rr.allreduce_(x, op=rr.Sum, name="ps.ar", process_set=pair)
        np.testing.assert_array_equal(g.host(x), sum(inputs(r, 6, np.float32) for r in ms))
        out = rr.broadcast(g.make(inputs(rank, 3, np.int32)), root_rank=1, name="ps.b",
                           process_set=pair)
        np.testing.assert_array_equal(g.host(out), inputs(ms[1], 3, np.int32))
        out = rr.allgather(g.make(inputs(rank, rank + 1, np.float64)), name="ps.ag",
                           process_set=pair)
        np.testing.assert_array_equal(g.host(out), np.concatenate(
            [inputs(r, r + 1, np.float64) for r in ms]))
        out = rr.alltoall(g.make(inputs(rank, 4, np.int64).reshape(2, 2)), name="ps.a2a",
                          process_set=pair)
        k = 2 // len(ms)  # rows to each member
        np.testing.assert_array_equal(g.host(out), np.concatenate(
            [inputs(r, 4, np.int64).reshape(2, 2)[me * k:(me + 1) * k] for r in ms]))
        out = rr.reducescatter(g.make(inputs(rank, 6, np.float32).reshape(3, 2)), op=rr.Sum,
                               name="ps.rs", process_set=pair)
        total = sum(inputs(r, 6, np.float32) for r in ms).reshape(3, 2)
        first, mine = (0, 3) if len(ms) == 1 else ((0, 2) if me == 0 else (2, 1))
        np.testing.assert_array_equal(g.host(out), total[first:first + mine])
    if solo is not None and solo.included():  # a set of one rank: its own communicator of one
        x = g.make(inputs(rank, 5, np.float32))
        assert rr.allreduce_(x, op=rr.Sum, name="solo", process_set=solo) is x
        np.testing.assert_array_equal(g.host(x), inputs(rank, 5, np.float32))


def check_join(g: Arrays, rank: int, size: int) -> None:
    # The last rank joins at once; the others run GPU collectives without it, through the
    # GPU executor it already has: neutral elements for every op (also compressed), the
    # allgather with 0 rows from it (the ranks agree on the counts in the executor), and
    # alltoall refused as on the host. Then every other rank joins.
    last, ranks = size - 1, range(size - 1)
    if rank == last:
        assert rr.join() in ranks
        return
    reduce = {rr.Sum: np.sum, rr.Min: np.min, rr.Max: np.max, rr.Product: np.prod}
    for dtype in (np.float32, np.int32, np.float16):
        for op, fn in reduce.items():
            x = g.make(inputs(rank, 6, dtype))
            rr.allreduce_(x, op=op, name=f"joined.{np.dtype(dtype).name}.{op}",
                          prescale_factor=-1.0 if dtype != np.float16 else 1.0)
            sign = -1 if dtype != np.float16 else 1
            want = fn(np.stack([sign * inputs(r, 6, dtype) for r in ranks]), axis=0)
            np.testing.assert_array_equal(g.host(x), want.astype(dtype))
    outs = rr.grouped_allreduce([g.make(inputs(rank, n, np.float64)) for n in (3, 9)],
                                op=rr.Product, name="joined.group")
    for n, o in zip((3, 9), outs):
        np.testing.assert_array_equal(g.host(o), np.prod([inputs(r, n, np.float64)
                                                          for r in ranks], axis=0))
    x = g.make(lossy(rank, 8))
    rr.allreduce_(x, op=rr.Min, name="joined.fp16", compression="fp16")
    np.testing.assert_array_equal(g.host(x), np.min([to_wire(lossy(r, 8), "fp16")
                                                     for r in ranks], axis=0))
    x = g.make(lossy(rank, 8))
    rr.allreduce_(x, op=rr.Average, name="joined.avg", compression="bf16")
    np.testing.assert_array_equal(
        g.host(x), sum(round_bf16(lossy(r, 8)) for r in ranks) * np.float32(1 / len(ranks)))
    out = rr.allgather(g.make(inputs(rank, (rank + 1) * 3, np.float32).reshape(-1, 3)),
                       name="joined.ag")
    np.testing.assert_array_equal(g.host(out), np.concatenate(
        [inputs(r, (r + 1) * 3, np.float32).reshape(-1, 3) for r in ranks]))
    outs = rr.grouped_allgather([g.make(inputs(rank, 2, np.int64)),
                                 g.make(inputs(rank, 4, np.float32))], name="joined.gag")
    np.testing.assert_array_equal(g.host(outs[1]), np.concatenate(
        [inputs(r, 4, np.float32) for r in ranks]))
    try:
        rr.alltoall(g.make(np.zeros((size, 2), np.float32)), name="joined.a2a")
    except rr.InvalidInputError as e:
        assert "cannot run while a rank has joined" in str(e), str(e)
    else:
        raise AssertionError("alltoall ran while a rank had joined")
    assert rr.join() in range(size)


def check_refusals(g: Arrays, rank: int, size: int) -> None:
    def refused(fn, match: str) -> None:
        try:
            fn()
        except rr.InvalidInputError as e:
            assert match in str(e), str(e)
            return
        raise AssertionError(f"not refused: {match}")

    if g.kind == "emulated":
        refused(lambda: rr.allreduce_(DlpackGpu(np.zeros(2, np.float32), rank + 5), name="w"),
                f"on CUDA device {rank + 5}, but this rank's GPU collectives run on device "
                f"{rank}")
        strided = CaiGpu(np.zeros((4, 4), np.float32), strides=(4, 16))
    else:
        strided = g.make(np.zeros((4, 4), np.float32)).T
    refused(lambda: rr.allreduce_(strided, name="s"), "need a C-contiguous array, got strides")
    refused(lambda: rr.allreduce(g.make(np.zeros(2, np.complex64), cai=True), name="c"),
            "complex64 is not supported")
    refused(lambda: rr.allreduce(g.make(np.zeros(2, np.float32)), op=rr.Adasum, name="g"),
            "on GPU, ringreduce runs allreduce, grouped_allreduce, allgather, broadcast")
    # Refused on one rank before the splits exchange: the other ranks hear of it.
    if size > 1:
        bad = [1] * size if rank == 0 else [0] * size
        try:
            rr.alltoall(g.make(np.zeros((size, 2), np.float32)), splits=bad, name="bad")
        except rr.RingReduceError as e:
            want = "refused this call locally" if rank == 0 else "splits must have one entry"
            assert want in str(e), str(e)
        else:
            raise AssertionError("alltoall with bad splits on rank 1 was not refused")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arrays", choices=["emulated", "cupy", "torch"], default="emulated")
    kind = parser.parse_args().arrays
    size = int(os.environ["WORLD_SIZE"])
    pair = rr.ProcessSet(sorted({0, size - 1}))  # {0, 2} at np=3, every rank at np=2
    solo = rr.ProcessSet([size - 1]) if size > 1 else None
    rr.init(process_sets=[pair] + ([solo] if solo else []))
    rank = rr.rank()
    set_rank(rank)
    g = Arrays(kind, rank)
    rr.register_gpu_array_type(DlpackGpu, lambda x, shape: DlpackGpu(np.empty(shape, x.a.dtype),
                                                                      x.device))
    rr.register_gpu_array_type(CaiGpu, lambda x, shape: CaiGpu(np.empty(shape, x.a.dtype)))
    check_process_sets(g, rank, pair, solo)
    check_allreduce(g, rank, size)
    check_described_allreduce(g, rank, size)
    check_out_of_place_and_fused(g, rank, size)
    check_broadcast(g, rank, size)
    check_reducescatter(g, rank, size)
    check_allgather(g, rank, size)
    check_alltoall(g, rank, size)
    check_refusals(g, rank, size)
    if kind == "torch":
        check_torch_low_precision(rank, size)
    if kind == "emulated":
        check_compression_emulated(rank, size)
    check_executor_compression(g, rank, size)
    check_join(g, rank, size)
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
