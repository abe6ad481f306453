"""ringreduce.torch collectives on torch tensors, ranks as threads: results, dtypes, autograd."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

torch.set_num_threads(1)

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
          torch.int64, torch.uint64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


def run(n, fn, return_exceptions=False):
    def body(c):
        with rrt.use_communicator(c):
            return fn(c.rank())

    return run_threaded(n, body, timeout=60, return_exceptions=return_exceptions)


def contribution(rank, dtype, shape=(5, 3)):
    g = torch.Generator().manual_seed(rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.6
    if dtype.is_floating_point:
        return (torch.randint(1, 5, shape, generator=g)).to(dtype)
    return torch.randint(0, 3, shape, generator=g).to(dtype)


def test_reexports_everything_of_ringreduce():
    missing = [n for n in rr.__all__ if not hasattr(rrt, n)]
    assert not missing
    for name in ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
                 "Compression", "SyncBatchNorm", "save_checkpoint", "load_checkpoint", "join"):
        assert callable(getattr(rrt, name)) or name == "Compression"


def test_horovod_build_queries_and_join_device():
    for name in ("mpi_built", "gloo_built", "ddl_built", "ccl_built", "rocm_built",
                 "mpi_enabled", "gloo_enabled", "mpi_threads_supported"):
        assert getattr(rrt, name)() is False, name
    # CUDA tensors run through NCCL: the build's and this process's truth.
    assert rrt.cuda_built() is rr.cuda_built() and rrt.nccl_built() is rr.nccl_built()
    with pytest.raises(rr.NotInitializedError, match="init"):
        rrt.size()
    assert run(2, lambda rank: rrt.join(device=-1)) in ([0, 0], [1, 1])
    with pytest.raises(rr.InvalidInputError, match="device"):
        rrt.join(device="cuda")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_queries_barrier_join(n):
    def fn(rank):
        rrt.barrier()
        return (rrt.rank(), rrt.size(), rrt.local_rank(), rrt.local_size(), rrt.cross_rank(),
                rrt.cross_size(), rrt.join())

    out = run(n, fn)
    for r, got in enumerate(out):
        assert got[:6] == (r, n, r, n, 0, 1)
        assert 0 <= got[6] < n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_every_dtype(dtype):
    n = 3

    def fn(rank):
        x = contribution(rank, dtype)
        out = {"new": rrt.allreduce(x, op=rrt.Sum if dtype != torch.bool else rrt.Max)}
        y = x.clone()
        assert rrt.allreduce_(y, op=rrt.Max, name="m") is y
        out["max"] = y
        h = rrt.allreduce_async(x, op=rrt.Min, name="min")
        out["min"] = rrt.synchronize(h)
        return out

    res = run(n, fn)
    xs = [contribution(r, dtype) for r in range(n)]
    stack = torch.stack([x.to(torch.float64) for x in xs])
    want_sum = stack.amax(0) if dtype == torch.bool else stack.sum(0)
    for r in range(n):
        for k, want in (("new", want_sum), ("max", stack.amax(0)), ("min", stack.amin(0))):
            got = res[r][k]
            assert got.dtype == dtype and got.shape == xs[0].shape, k
            assert torch.equal(got.to(torch.float64), want.to(dtype).to(torch.float64)), k


def test_allreduce_average_scaling_and_op_spellings():
    def fn(rank):
        x = torch.full((4,), float(rank + 1))
        return [rrt.allreduce(x), rrt.allreduce(x, average=False), rrt.allreduce(x, True),
                rrt.allreduce(x, rrt.Sum), rrt.allreduce(x, op=rrt.Sum, prescale_factor=2.0,
                                                         postscale_factor=0.5),
                rrt.allreduce(x, compression=rrt.Compression.fp16)]

    for got in run(2, fn):
        assert [float(t[0]) for t in got] == [1.5, 3.0, 1.5, 3.0, 3.0, 1.5]
        assert got[-1].dtype == torch.float32


def test_a_failed_handle_raises_on_every_wait():
    """Like the numpy-level handle: a second synchronize() of a failed collective raises
    again (it returned None), and poll() says it is done."""

    def fn(rank):
        h = rrt.allreduce_async(torch.ones(2 + rank), name="mismatch")
        errors = []
        for _ in range(2):
            try:
                rrt.synchronize(h)
            except rr.MismatchError as err:
                errors.append(type(err).__name__)
        return errors, rrt.poll(h)

    assert run(2, fn) == [(["MismatchError"] * 2, True)] * 2


def test_bad_arguments_are_clear():
    rrt.init()
    try:
        with pytest.raises(rr.InvalidInputError, match="either op= or"):
            rrt.allreduce(torch.ones(2), average=True, op=rrt.Sum)
        for op in (17, 1.0, 1 + 0j, "sum", True):  # 1.0 and 1+0j hash like Average
            with pytest.raises(rr.InvalidInputError, match="op must be one of"):
                rrt.allreduce(torch.ones(2), op=op)
        with pytest.raises(rr.InvalidInputError, match="expected a torch.Tensor"):
            rrt.allreduce_async_(np.ones(2))
        with pytest.raises(rr.InvalidInputError, match="complex64 tensors are not supported") \
                as err:
            rrt.allreduce(torch.ones(2, dtype=torch.complex64))
        assert "t.to(torch." in str(err.value) and "astype" not in str(err.value), err.value
        for call in (rrt.broadcast, rrt.broadcast_async):  # errors name the call made
            with pytest.raises(rr.InvalidInputError, match=r"root_rank must be") as err:
                call(torch.ones(2), root_rank=5)
            assert f"{call.__name__}_" not in str(err.value), err.value
        with pytest.raises(rr.InvalidInputError, match="to_dense"):
            rrt.allreduce(torch.ones(2).to_sparse())
    finally:
        rrt.shutdown()


def test_in_place_on_non_contiguous_and_async_poll():
    def fn(rank):
        base = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
        col = base.t()  # non-contiguous view into base
        h = rrt.allreduce_async_(col, op=rrt.Sum, name="col")
        assert rrt.synchronize(h) is col
        assert rrt.poll(h)
        base[:, 1] = rank
        hb = rrt.broadcast_async_(base[:, 1], root_rank=1, name="b")
        rrt.synchronize(hb)
        blocking = (torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)).t()
        assert rrt.allreduce_(blocking, op=rrt.Sum, name="blocking") is blocking
        return base, blocking

    want = torch.arange(12, dtype=torch.float32).view(3, 4) * 3
    for got, blocking in run(2, fn):
        assert torch.equal(blocking, want.t())
        want_b = want.clone()
        want_b[:, 1] = 1
        assert torch.equal(got, want_b)


def test_grouped_allreduce():
    def fn(rank):
        xs = [torch.full((3,), float(rank)), torch.full((2, 2), rank, dtype=torch.int64)]
        new = rrt.grouped_allreduce(xs, op=rrt.Sum, name="g")
        same = rrt.grouped_allreduce_([x.clone() for x in xs], op=rrt.Sum, name="gi")
        h = rrt.grouped_allreduce_async(xs, op=rrt.Max)
        # Horovod's positional order: tensors, average, name, compression, op.
        half = rrt.grouped_allreduce([torch.full((3,), rank + 0.5)], None, "gc",
                                     rrt.Compression.fp16, rrt.Sum)
        return new, same, rrt.synchronize(h), half

    for new, same, mx, half in run(2, fn):
        for got in (new, same):
            assert torch.equal(got[0], torch.full((3,), 1.0))
            assert torch.equal(got[1], torch.full((2, 2), 1, dtype=torch.int64))
        assert torch.equal(mx[0], torch.full((3,), 1.0))
        assert half[0].dtype == torch.float32 and torch.equal(half[0], torch.full((3,), 2.0))


def test_allgather_broadcast_reducescatter_alltoall():
    n = 3

    def fn(rank):
        out = {"gather": rrt.allgather(torch.full((rank + 1, 2), rank, dtype=torch.int32))}
        out["gather_async"] = rrt.synchronize(rrt.allgather_async(torch.tensor([rank])))
        out["bcast"] = rrt.broadcast(torch.tensor([rank, 7], dtype=torch.bfloat16), root_rank=2)
        out["bcast_async"] = rrt.synchronize(rrt.broadcast_async(torch.tensor([rank]), 1))
        x = torch.arange(7, dtype=torch.float64) * (rank + 1)
        out["rs"] = rrt.reducescatter(x, op=rrt.Sum)
        out["rs_async"] = rrt.synchronize(rrt.reducescatter_async(x, op=rrt.Sum))
        out["a2a"] = rrt.alltoall(torch.arange(3) + 10 * rank)
        sent = torch.arange(rank + 3) + 10 * rank
        splits = [1, 1, rank + 1]
        out["a2a_split"] = rrt.alltoall(sent, splits=torch.tensor(splits))
        out["a2a_async"] = rrt.synchronize(rrt.alltoall_async(sent, splits=splits))
        return out

    res = run(n, fn)
    gather = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int32) for r in range(n)])
    total = torch.arange(7, dtype=torch.float64) * 6
    shares = [total[0:3], total[3:5], total[5:7]]
    for r, out in enumerate(res):
        assert torch.equal(out["gather"], gather)
        assert torch.equal(out["gather_async"], torch.arange(n))
        assert out["bcast"].dtype == torch.bfloat16
        assert torch.equal(out["bcast"], torch.tensor([2, 7], dtype=torch.bfloat16))
        assert torch.equal(out["bcast_async"], torch.tensor([1]))
        assert torch.equal(out["rs"], shares[r]) and torch.equal(out["rs_async"], shares[r])
        assert torch.equal(out["a2a"], torch.tensor([r, 10 + r, 20 + r]))
        got, received = out["a2a_split"]
        want = torch.tensor([10 * j + (r if r < 2 else 2 + k)
                             for j in range(n) for k in range(1 if r < 2 else j + 1)])
        assert torch.equal(received, torch.tensor([1, 1, 1] if r < 2 else [1, 2, 3]))
        assert torch.equal(got, want)
        assert torch.equal(out["a2a_async"][0], want)


def test_objects():
    def fn(rank):
        return (rrt.broadcast_object({"rank": rank, "t": torch.ones(2) * rank}, root_rank=1),
                rrt.allgather_object(("r", rank)))

    for b, g in run(2, fn):
        assert b["rank"] == 1 and torch.equal(b["t"], torch.ones(2))
        assert g == [("r", 0), ("r", 1)]


# ------------------------------------------------------------------ autograd
def reference_grads(xs, f):
    """Gradients of sum_r f_r(everyone's x) computed in one process."""
    leaves = [x.clone().requires_grad_() for x in xs]
    f(leaves).backward()
    return [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]


def weights(rank, shape):
    return torch.arange(float(np.prod(shape)), dtype=torch.float64).view(shape) + 10 * rank


def check_grads(n, make_x, op_dist, loss_ref, factor=1.0):
    """``factor``: Horovod's gradient of the collective relative to that of the sum of the
    ranks' losses (1/n for allgather and broadcast, n for reducescatter)."""
    xs = [make_x(r) for r in range(n)]

    def fn(rank):
        x = xs[rank].clone().requires_grad_()
        y = op_dist(x, rank)
        (y * weights(rank, y.shape)).sum().backward()
        return y.detach(), x.grad

    res = run(n, fn)
    want = reference_grads(xs, loss_ref)
    for r in range(n):
        torch.testing.assert_close(res[r][1], want[r] * factor)
    return res


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_allreduce_gradient(op):
    n, o = 3, getattr(rrt, op)

    def ref(leaves):
        s = sum(leaves) / (n if op == "Average" else 1) * 2.0
        return sum((s * weights(r, s.shape)).sum() for r in range(n))

    res = check_grads(n, lambda r: torch.randn(4, generator=torch.Generator().manual_seed(r),
                                               dtype=torch.float64),
                      lambda x, r: rrt.allreduce(x, op=o, name="ar", postscale_factor=2.0),
                      ref)
    assert torch.equal(res[0][0], res[1][0])


def test_allgather_gradient():
    n = 3

    def ref(leaves):
        cat = torch.cat(leaves)
        return sum((cat * weights(r, cat.shape)).sum() for r in range(n))

    check_grads(n, lambda r: torch.ones(r + 1, 2, dtype=torch.float64) * r,
                lambda x, r: rrt.allgather(x, name="ag"), ref, factor=1 / n)


def test_broadcast_gradient():
    n = 3

    def ref(leaves):
        return sum((leaves[1] * weights(r, leaves[1].shape)).sum() for r in range(n))

    res = check_grads(n, lambda r: torch.ones(2, 2, dtype=torch.float64) * r,
                      lambda x, r: rrt.broadcast(x, root_rank=1, name="bc"), ref, factor=1 / n)
    assert torch.equal(res[0][0], torch.ones(2, 2, dtype=torch.float64))


def test_reducescatter_and_alltoall_gradients():
    n = 2

    def ref_rs(leaves):
        total = sum(leaves) / n
        return sum((total[3 * r:3 * r + 3] * weights(r, (3,))).sum() for r in range(n))

    check_grads(n, lambda r: torch.arange(6, dtype=torch.float64) + r,
                lambda x, r: rrt.reducescatter(x, op=rrt.Average), ref_rs, factor=n)

    def ref_a2a(leaves):
        # rank r sends rows [0:1] to rank 0 and [1:1+r+1]... splits [1, r + 1]
        outs = [torch.cat([leaves[j][:1] if r == 0 else leaves[j][1:] for j in range(n)])
                for r in range(n)]
        return sum((o * weights(r, o.shape)).sum() for r, o in enumerate(outs))

    check_grads(n, lambda r: torch.arange(r + 2, dtype=torch.float64) + 5 * r,
                lambda x, r: rrt.alltoall(x, splits=[1, r + 1])[0], ref_a2a)


def test_min_has_no_gradient():
    def fn(rank):
        x = torch.ones(2, requires_grad=True)
        rrt.allreduce(x, op=rrt.Min).sum().backward()

    for err in run(2, fn, return_exceptions=True):
        assert isinstance(err, rr.InvalidInputError) and "no gradient" in str(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_zeros_tensor_takes_the_shared_path(dtype):
    """4 MiB (the default RINGREDUCE_SHARED_MIN_BYTES) in a shared tensor: read in place."""
    cols = (4 << 20) // 1024 // torch.empty((), dtype=dtype).element_size()

    def fn(rank):
        t = rrt.shared_zeros((1024, cols), dtype)
        ok = (t.dtype == dtype and t.is_contiguous() and t.nbytes == 4 << 20
              and not t.any() and rrt.shared_zeros(0, dtype).numel() == 0)
        t.fill_(rank + 1)
        engine = rr._comm()._engine
        before = engine.stats()["shared_allreduces"]
        rrt.allreduce_(t, op=rrt.Sum, name="shared")
        return ok, bool((t == 3).all()), engine.stats()["shared_allreduces"] - before

    assert run(2, fn) == [(True, True, 1), (True, True, 1)]


def test_scale_factors_must_be_finite_numbers():
    rrt.init()
    try:
        for requires_grad in (False, True):
            x = torch.ones(4, requires_grad=requires_grad)
            for call in (rrt.allreduce, rrt.reducescatter):
                with pytest.raises(rr.InvalidInputError, match="must be finite real numbers"):
                    call(x, prescale_factor=float("nan"))
                with pytest.raises(rr.InvalidInputError, match="must be finite real numbers"):
                    call(x, postscale_factor="2")
    finally:
        rrt.shutdown()


@pytest.mark.parametrize("case", ["allreduce", "grouped", "alltoall"])
def test_call_refused_by_the_torch_layer_on_one_rank_fails_the_others(case):
    """Rank 1's call fails the torch layer's own checks (before any Communicator call):
    rank 0's matching call raises at once, naming rank 1, instead of waiting forever; the
    next unnamed call lines up again."""
    def body(rank):
        bad = rank == 1
        x = torch.ones(4, dtype=torch.complex64 if bad else torch.float32)
        if case == "allreduce":
            out = rrt.allreduce(x)
        elif case == "grouped":
            out = rrt.synchronize(rrt.grouped_allreduce_async_([torch.ones(2), x]))
        else:
            with torch.no_grad():  # rank 1: 3 rows do not divide by 2 (checked in torch layer)
                out = rrt.alltoall(torch.ones(3 if bad else 4))
        return out

    errs = run(2, body, return_exceptions=True)
    assert isinstance(errs[1], rr.InvalidInputError), errs
    assert isinstance(errs[0], rr.MismatchError), errs
    assert "rank 1 refused this call locally" in str(errs[0]), errs[0]
    after = run(2, lambda rank: rrt.allreduce(torch.full((2,), float(rank)), op=rrt.Sum))
    assert all(torch.equal(a, torch.ones(2)) for a in after), after


def test_only_builtin_casts_of_cuda_tensors_are_left_to_the_gpu_executor():
    # CUDA tensors with Compression.fp16 / .bf16 go to the GPU executor uncast (its fusion
    # kernels cast them; tests/workers/gpu_worker.py checks the bits on GPUs); CPU tensors
    # and compressors with their own casts keep the framework's cast.
    from ringreduce.torch.compression import FP16Compressor, device_compression

    class CudaLike:
        is_cuda = True

    class Custom(FP16Compressor):
        @classmethod
        def compress(cls, tensor):
            return super().compress(tensor)

    assert device_compression(rrt.Compression.fp16, CudaLike()) == "fp16"
    assert device_compression(rrt.Compression.bf16, CudaLike()) == "bf16"
    assert device_compression(rrt.Compression.fp16, torch.ones(2)) is None
    assert device_compression(rrt.Compression.none, CudaLike()) is None
    assert device_compression(Custom, CudaLike()) is None


def test_compression_keyword_is_refused_for_host_arrays_on_every_rank():
    def fn(c):
        with pytest.raises(rr.InvalidInputError, match="compression= applies to GPU arrays"):
            c.allreduce(np.ones(3, np.float32), name="h", compression="fp16")
        with pytest.raises(rr.InvalidInputError, match="compression must be None"):
            c.allreduce(_Cuda(), name="g", compression="fp8")
        return c.allreduce(np.ones(2), op=rr.Sum, name="after", compression="none").tolist()

    assert run_threaded(2, fn, timeout=60) == [[2.0, 2.0]] * 2


class _Cuda:
    """An array claiming CUDA device 0 (refused before any device work)."""

    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0x1000, False),
                                "version": 3}
