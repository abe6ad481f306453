"""Horovod names of ringreduce.torch beyond the basics: the grouped allgather and
reducescatter (and the grouped calls' autograd), sparse_allreduce_async, Horovod's
exception names. Threads as ranks, 2 and 3 of them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

torch.set_num_threads(1)


def run(n, fn, return_exceptions=False):
    def body(c):
        with rrt.use_communicator(c):
            return fn(c.rank())

    return run_threaded(n, body, timeout=60, return_exceptions=return_exceptions)


def ragged(rank, i):
    """Member i of rank's group: rank + 1 + i rows, float64."""
    return torch.arange((rank + 1 + i) * 2, dtype=torch.float64).view(-1, 2) + 100 * rank + i


@pytest.mark.parametrize("n", [2, 3])
def test_grouped_allgather_matches_single_calls(n):
    def fn(rank):
        xs = [ragged(rank, i) for i in range(3)]
        return (rrt.grouped_allgather(xs, name="g"),
                rrt.synchronize(rrt.grouped_allgather_async(xs)),
                [rrt.allgather(x, name=f"s{i}") for i, x in enumerate(xs)])

    for grouped, grouped_async, single in run(n, fn):
        for g, a, s in zip(grouped, grouped_async, single):
            assert torch.equal(g, s) and torch.equal(a, s)
        assert grouped[2].shape == (sum(r + 3 for r in range(n)), 2)


@pytest.mark.parametrize("n", [2, 3])
def test_grouped_reducescatter_matches_single_calls(n):
    def fn(rank):
        xs = [torch.arange(7 * 2, dtype=torch.float32).view(7, 2) * (rank + 1),
              torch.ones(n * 2, dtype=torch.int64) * rank]
        kw = {"op": rrt.Sum, "prescale_factor": 2.0}
        return (rrt.grouped_reducescatter(xs, name="rs", **kw),
                rrt.synchronize(rrt.grouped_reducescatter_async(xs, op=rrt.Average)),
                [rrt.reducescatter(x, name=f"s{i}", **kw) for i, x in enumerate(xs)],
                [rrt.reducescatter(x, op=rrt.Average) for x in xs])

    for grouped, grouped_avg, single, single_avg in run(n, fn):
        for g, s in zip(grouped + grouped_avg, single + single_avg):
            assert g.dtype == s.dtype and torch.equal(g, s)


def test_grouped_calls_refuse_what_is_not_a_list():
    def fn(rank):
        errors = []
        for call in (lambda: rrt.grouped_allgather(torch.ones(2)),
                     lambda: rrt.grouped_reducescatter([]),
                     lambda: rr.grouped_allgather([])):
            with pytest.raises(rr.InvalidInputError, match="non-empty list"):
                call()
            errors.append(True)
        return errors

    assert run(2, fn) == [[True] * 3] * 2


def _grads(make, call, n):
    """Per rank: the gradients of sum(out * weights) through ``call``."""

    def fn(rank):
        xs = [x.requires_grad_() for x in make(rank)]
        outs = call(xs)
        loss = sum((o * (torch.arange(o.numel(), dtype=o.dtype).view(o.shape) + rank)).sum()
                   for o in outs)
        loss.backward()
        return [x.grad for x in xs]

    return run(n, fn)


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "reducescatter"])
def test_grouped_gradients_equal_the_single_calls(kind):
    n = 3

    def make(rank):
        if kind == "allgather":
            return [ragged(rank, i) for i in range(2)]
        return [torch.arange(6, dtype=torch.float64) * (rank + 1) + i for i in range(2)]

    grouped = {"allreduce": lambda xs: rrt.grouped_allreduce(xs, op=rrt.Average,
                                                             postscale_factor=3.0),
               "allgather": lambda xs: rrt.grouped_allgather(xs, name="ag"),
               "reducescatter": lambda xs: rrt.grouped_reducescatter(xs, op=rrt.Sum)}[kind]
    single = {"allreduce": lambda xs: [rrt.allreduce(x, op=rrt.Average, postscale_factor=3.0)
                                       for x in xs],
              "allgather": lambda xs: [rrt.allgather(x) for x in xs],
              "reducescatter": lambda xs: [rrt.reducescatter(x, op=rrt.Sum) for x in xs]}[kind]
    for g, s in zip(_grads(make, grouped, n), _grads(make, single, n)):
        for a, b in zip(g, s):
            torch.testing.assert_close(a, b)


def test_grouped_allreduce_gradient_with_an_unused_output():
    """An output that gets no gradient still takes part (zeros), so ranks stay matched."""

    def fn(rank):
        a, b = (torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True))
        out = rrt.grouped_allreduce([a, b], op=rrt.Sum)
        (out[0] * (rank + 1)).sum().backward()
        return a.grad, b.grad

    for ga, gb in run(2, fn):
        assert torch.equal(ga, torch.full((3,), 3.0))
        assert torch.equal(gb, torch.zeros(2))


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_sparse_allreduce_async(op):
    def fn(rank):
        idx = torch.tensor([[rank, 4]])
        t = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0]) * (rank + 1), (6,),
                                    check_invariants=True)
        return rrt.synchronize(rrt.sparse_allreduce_async(t, name="sp", op=getattr(rrt, op)))

    want = torch.tensor([1.0, 2.0, 0, 0, 2.0 + 4.0, 0])
    if op == "Average":
        want = want / 2
    for out in run(2, fn):
        assert out.is_sparse and torch.equal(out.to_dense(), want)


def test_sparse_allreduce_async_refuses_dense():
    with pytest.raises(rr.InvalidInputError, match="sparse COO"):
        rrt.sparse_allreduce_async(torch.ones(2), "x")


def test_horovod_exception_names():
    for mod in (rr, rrt):
        assert mod.HorovodInternalError is rr.RingReduceError
        assert issubclass(mod.HostsUpdatedInterrupt, rr.RingReduceError)
    assert issubclass(rr.PeerLostError, rrt.HorovodInternalError)
    assert issubclass(rr.MismatchError, rrt.HorovodInternalError)
    assert rrt.HostsUpdatedInterrupt(skip_sync=True).skip_sync
