"""GPU arrays from Python into the engine, end to end in real processes at np=2 on
emulated GPUs (RINGREDUCE_GPU_EMULATE=1, csrc/gpu/emulated_gpu_ops.cc), and at np=3
with a process set {0, 2} on GPU: the DLPack and
__cuda_array_interface__ intake, the device / contiguity / dtype refusals, out-of-place
results in the array's own type, fusion, broadcast, and the NCCL bootstrap across
processes (tests/workers/gpu_worker.py). Also: without emulation, a GPU array on
this machine (no GPU) fails on every rank with what is missing."""

from __future__ import annotations

import numpy as np
import pytest
from procs import WORKERS, run_env_launch

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

WORKER = WORKERS / "gpu_worker.py"


@pytest.mark.parametrize("np_", [2, 3])
def test_gpu_collectives_on_emulated_gpus(np_):
    # np=3 also runs a process set {0, 2} on GPU (its own communicator; rank 1 stays out).
    job = run_env_launch(np_, WORKER, ["--arrays", "emulated"],
                         env={"RINGREDUCE_GPU_EMULATE": "1"}, timeout=120)
    job.check_ok(expect_ranks=np_)


class _HostBufferOnCuda:
    """Claims CUDA device 0 through __cuda_array_interface__ (never read: no GPU here)."""

    def __init__(self) -> None:
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4",
                                         "data": (0x1000, False), "version": 3}


def test_without_a_gpu_every_rank_fails_with_what_is_missing():
    if rr.gpu_info()["cuda_device_count"]:
        pytest.skip("this machine has a GPU: tests/gpu/ covers it")

    def fn(c):
        try:
            c.allreduce_(_HostBufferOnCuda(), name="g")
        except rr.InvalidInputError as e:
            msg = str(e)
        np.testing.assert_array_equal(c.allreduce(np.ones(2), op=rr.Sum, name="h"), [2, 2])
        return msg

    for r, msg in enumerate(run_threaded(2, fn, timeout=60)):
        assert f"rank {r}: allreduce 'g': the tensor is on GPU 0" in msg, msg
        assert "GPU collectives need every rank to have a GPU (rank 0: " in msg, msg
        assert "rank 1: " in msg, msg


class _DlpackOnGpu:
    """A host buffer that says it is on CUDA device ``device`` (emulated GPUs read it)."""

    def __init__(self, a: np.ndarray, device: int) -> None:
        self.a, self.device = a, device

    def __dlpack_device__(self):
        return (2, self.device)

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()


@pytest.mark.parametrize("hosts", [
    ["a", "a", "b", "b"],  # equal hosts: one ring per local rank
    ["a", "a", "b"],  # 2 + 1: rank 2 carries both shards across
    ["a", "b", "b", "a", "b"],  # 2 + 3, interleaved: 6 units, 4 cross-host pieces
])
def test_hierarchical_gpu_allreduce_on_emulated_gpus_and_fake_hosts(hosts):
    # NCCL reduce-scatter in the host, the CPU ring(s) across hosts, NCCL allgather in the
    # host; a fused group and a single tensor, Sum and Average; hosts of any rank count.
    from conftest import env

    n = len(hosts)
    with env(RINGREDUCE_HIERARCHICAL_ALLREDUCE="1", RINGREDUCE_GPU_EMULATE="1"):
        world = make_world(n, hosts)

    def data(r, k):
        return (np.arange(k) % 5 + r).astype(np.float32)

    def fn(c):
        r = c.rank()
        xs = [_DlpackOnGpu(data(r, k), r) for k in (7, 1000)]
        c.grouped_allreduce_async_(xs, op=rr.Sum).wait()
        one = _DlpackOnGpu(data(r, 13), r)
        c.allreduce_(one, op=rr.Average, name="one")
        tiny = _DlpackOnGpu(data(r, 1), r)  # fewer elements than units: zero padding
        c.allreduce_(tiny, op=rr.Max, name="tiny")
        return [x.a for x in xs], one.a, tiny.a, c._engine.stats()["hierarchical_allreduces"]

    try:
        out = run_threaded(n, fn, world=world, timeout=60)
    finally:
        for c in world:
            c.close()
    for xs, one, tiny, ran in out:
        assert ran == 3
        for x, k in zip(xs, (7, 1000)):
            np.testing.assert_array_equal(x, sum(data(r, k) for r in range(n)))
        np.testing.assert_allclose(one, np.mean([data(r, 13) for r in range(n)], axis=0))
        np.testing.assert_array_equal(tiny, [n - 1])


def test_hierarchical_gpu_allreduce_within_a_process_set():
    # 4 ranks on hosts a a b b; the set {0, 1, 2} sits on both hosts unevenly (2 + 1) and
    # runs hierarchically among its members (rank 3 takes no part); compressed too.
    from conftest import env

    from ringreduce import ProcessSet

    with env(RINGREDUCE_HIERARCHICAL_ALLREDUCE="1", RINGREDUCE_GPU_EMULATE="1"):
        world = make_world(4, ["a", "a", "b", "b"])

    def data(r, k):
        return (np.arange(k) % 5 + r).astype(np.float32)

    def fn(c):
        (ps,) = mine = [ProcessSet([0, 1, 2])]
        c.process_sets.setup(mine)
        r = c.rank()
        if r == 3:
            return None
        with rr.use_communicator(c):
            x = _DlpackOnGpu(data(r, 1001), r)
            rr.allreduce_(x, op=rr.Average, name="ps.h", process_set=ps)
            y = _DlpackOnGpu(data(r, 9) + 2.0 ** -12, r)
            rr.allreduce_(y, op=rr.Sum, name="ps.hc", process_set=ps, compression="fp16")
        return x.a, y.a, c._engine.stats()["hierarchical_allreduces"]

    try:
        out = run_threaded(4, fn, world=world, timeout=60)
    finally:
        for c in world:
            c.close()
    assert out[3] is None
    for x, y, ran in out[:3]:
        assert ran == 2
        np.testing.assert_allclose(x, np.mean([data(r, 1001) for r in range(3)], axis=0),
                                   rtol=1e-6)
        np.testing.assert_array_equal(y, sum(data(r, 9) for r in range(3)))  # fp16-rounded


class _Cai:
    """A GPU array through __cuda_array_interface__ v3 alone (never read here)."""

    def __init__(self, typestr: str = "<f4", stream=None) -> None:
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": typestr, "version": 3,
                                         "data": (0x1000, False), "stream": stream}


def test_intake_orders_after_the_callers_stream_and_refuses_what_nccl_lacks():
    from ringreduce._cuda_arrays import cuda_view

    # The executor records its event on the engine thread: cudaStreamPerThread (2) would
    # be that thread's own empty stream there, so it becomes the legacy default stream (0),
    # which follows every blocking stream's work. Other streams pass through as they are.
    for given, used in [(None, 0), (1, 0), (2, 0), (7, 7)]:
        assert cuda_view(_Cai(stream=given), "allreduce", "s").stream == used
    # Refused at intake, before anything is enqueued (NCCL has no 16-bit integers).
    for typestr in ("<i2", "<u2", "<u4", "<u8"):
        with pytest.raises(rr.InvalidInputError, match="is not supported on GPU"):
            cuda_view(_Cai(typestr), "allreduce", "s")


JOIN_FIRST = """
import sys
import numpy as np
sys.path.insert(0, {workers!r})
import ringreduce as rr
from gpu_worker import DlpackGpu
rr.init()
rr.register_gpu_array_type(DlpackGpu, lambda x, shape: DlpackGpu(np.empty(shape, x.a.dtype),
                                                                  x.device))
if rr.rank() == 1:
    last = rr.join()  # before any GPU call of its own
else:
    x = DlpackGpu(np.arange(6, dtype=np.float32), 0)  # rank 0 on GPU 0
    assert rr.allreduce_(x, op=rr.Sum, name="g").a.tolist() == list(range(6))
    last = rr.join()
assert last == 0, last
# The joined rank took part on its own GPU (local_rank 1), not on rank 0's.
print("DEVICE", rr.rank(), rr._comm()._engine.stats()["gpu_device"])
rr.shutdown()
"""


def test_a_rank_that_joins_before_any_gpu_call_uses_its_own_gpu(tmp_path):
    script = tmp_path / "join_first.py"
    script.write_text(JOIN_FIRST.format(workers=str(WORKERS)))
    job = run_env_launch(2, script, env={"RINGREDUCE_GPU_EMULATE": "1"}, timeout=60)
    job.check_ok()
    out = job.describe()
    assert "DEVICE 0 0" in out and "DEVICE 1 1" in out, out
