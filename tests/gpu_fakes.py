"""Helpers of the GPU executor's tests without a GPU (tests/test_gpu_executor.py,
tests/test_gpu_compression.py, tests/test_gpu_completion.py): made-up device tensors, an
executor over FakeGpuOps (csrc/gpu/fake_gpu_ops.cc, which logs every CUDA / NCCL call in
order), readers of its log, and engines (one, or a threaded world) with fake GPUs."""

from __future__ import annotations

import time

from ringreduce._core.gpu import testing as gt

from ringreduce.testing import make_world, run_threaded

F32, F64, I32, F16, BF16 = 6, 7, 2, 4, 5
SUM, AVG, MIN, MAX, PROD = 0, 1, 2, 3, 4
NCCL_2_27, NCCL_2_9 = 22703, 20903  # ncclAvg exists from 2.10 on
FUSION = 0x10000000  # the fake's first device allocation


def tensor(name, n, i=0, **kw):
    """A float32 tensor on 'device memory' at made-up addresses (never dereferenced)."""
    d = {"name": name, "shape": [n], "dtype": F32, "op": SUM,
         "in": 0x7000000 + i * 0x100000, "out": 0x8000000 + i * 0x100000}
    d.update(kw)
    return d


def fake_gpu(engine, poll_s=None):
    """GPU 0 of ``engine`` as a fresh FakeGpuOps (returned); ``poll_s``: the idle engine
    thread's longest sleep while GPU work is in flight."""
    ops = gt.FakeGpuOps()
    gt.use_fake_gpus(engine, {0: ops})
    if poll_s is not None:
        gt.set_device_poll(engine, poll_s)
    return ops


def fake_gpu_world(size, fn, timeout=60):
    """``run_threaded(size, fn(comm, fakes))`` over a threaded world whose rank r has
    GPU r as a FakeGpuOps of its own (communicators made by the real bootstrap); the world
    is closed after. Returns every rank's result."""
    fakes = [gt.FakeGpuOps(id_seed=0x90 + r) for r in range(size)]
    world = make_world(size)
    try:
        for r, c in enumerate(world):
            gt.use_fake_gpus(c._engine, {r: fakes[r]}, bootstrap=True)
        return run_threaded(size, lambda c: fn(c, fakes), world=world, timeout=timeout)
    finally:
        for c in world:
            c.close()


def wait_done(h, timeout=10.0):
    """Until the handle ``h`` is done (it may have failed); an AssertionError after ``timeout``."""
    end = time.monotonic() + timeout
    while not h.done():
        assert time.monotonic() < end, "handle did not complete"
        time.sleep(0.001)


def executor(nccl_version=NCCL_2_27, size=2, **kw):
    """A GpuExecutor of rank 0 over a fresh FakeGpuOps, its communicator made, log empty."""
    ops = gt.FakeGpuOps(nccl_version)
    ex = gt.GpuExecutor(ops, device=0, rank=0, size=size, **kw)
    ex.init_comm(bytes(128))
    ops.clear_calls()
    return ops, ex


def verbs(ops):
    """The calls logged so far, by name."""
    return [c.split()[0] for c in ops.calls()]


def call(ops, verb):
    """The one logged call named ``verb``, split into words."""
    (line,) = [c for c in ops.calls() if c.startswith(verb + " ")]
    return line.split()
