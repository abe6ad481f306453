"""Adasum (op=Adasum): the numpy and torch allreduce, and DistributedOptimizer's delta
form, against a float64 reference of the recursive pairwise formula written here."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ringreduce as rr
from ringreduce.testing import run_threaded


def reference(vectors):
    """Horovod's pairing written independently: a recursion over the halves of the list
    padded to a power of two (an absent partner is None and passes the other through)."""

    def combine(a, b):
        if a is None or b is None:
            return a if b is None else b
        dot = a @ b
        ca = 1 - dot / (2 * (a @ a)) if a @ a >= 1e-8 else 1.0
        cb = 1 - dot / (2 * (b @ b)) if b @ b >= 1e-8 else 1.0
        return ca * a + cb * b

    def tree(vs):
        if len(vs) == 1:
            return vs[0]
        half = len(vs) // 2
        return combine(tree(vs[:half]), tree(vs[half:]))

    width = 1
    while width < len(vectors):
        width *= 2
    padded = [np.asarray(v, np.float64) for v in vectors] + [None] * (width - len(vectors))
    return tree(padded)


def contribution(rank, shape=(5, 3), dtype=np.float32):
    rng = np.random.default_rng(rank)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_adasum_matches_the_reference(n):
    def fn(c):
        x = contribution(c.rank())
        y = contribution(c.rank() + 10, (7,), np.float64)
        out = c.allreduce(x, op=rr.Adasum, name="x")
        grouped = c.grouped_allreduce([x, y], op=rr.Adasum, name="g", postscale_factor=0.5)
        inplace = x.copy()
        c.allreduce_(inplace, op=rr.Adasum)
        return out, grouped, inplace

    res = run_threaded(n, fn, timeout=60)
    want_x = reference([contribution(r).ravel() for r in range(n)]).reshape(5, 3)
    want_y = reference([contribution(r + 10, (7,), np.float64) for r in range(n)])
    for out, grouped, inplace in res:
        assert out.dtype == np.float32 and out.shape == (5, 3)
        np.testing.assert_allclose(out, want_x.astype(np.float32), rtol=1e-6)
        np.testing.assert_allclose(grouped[0], (want_x * 0.5).astype(np.float32), rtol=1e-6)
        np.testing.assert_allclose(grouped[1], want_y * 0.5, rtol=1e-12)
        assert np.array_equal(inplace, out)
        assert np.array_equal(out, res[0][0])  # bitwise the same on every rank


def test_adasum_of_parallel_and_orthogonal_gradients():
    """The operator's two defining cases: equal vectors average, orthogonal ones add."""

    def fn(c):
        same = c.allreduce(np.array([2.0, 4.0]), op=rr.Adasum)
        orth = c.allreduce(np.array([1.0, 0.0]) if c.rank() == 0 else np.array([0.0, 3.0]),
                           op=rr.Adasum)
        return same, orth

    for same, orth in run_threaded(2, fn, timeout=60):
        np.testing.assert_allclose(same, [2.0, 4.0])
        np.testing.assert_allclose(orth, [1.0, 3.0])


def test_adasum_refuses_integers_and_reducescatter():
    def fn(c):
        with pytest.raises(rr.InvalidInputError, match="floating-point"):
            c.allreduce(np.ones(3, np.int32), op=rr.Adasum)
        with pytest.raises(rr.InvalidInputError, match="op must be"):
            c.reducescatter(np.ones(4, np.float32), op=rr.Adasum)
        return True

    assert run_threaded(2, fn, timeout=60) == [True, True]

    def one_rank_refuses(c):  # rank 1's integers never reach an allgather: rank 0 hears of it
        dtype = np.int32 if c.rank() else np.float32
        return c.grouped_allreduce([np.ones(3, np.float32), np.ones(2, dtype)], op=rr.Adasum)

    errs = run_threaded(2, one_rank_refuses, timeout=60, return_exceptions=True)
    assert isinstance(errs[1], rr.InvalidInputError), errs
    assert "rank 1 refused this call locally" in str(errs[0]), errs


def test_torch_adasum_allreduce_and_optimizer():
    torch = pytest.importorskip("torch")
    import ringreduce.torch as rrt

    n, lr = 3, 0.1

    lock = threading.Lock()  # the ranks are threads: torch's global RNG is shared

    def make():
        with lock:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                       torch.nn.Linear(3, 1))

    def data(rank):
        g = torch.Generator().manual_seed(rank)
        return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    def fn(c):
        with rrt.use_communicator(c):
            model = make()
            opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                           named_parameters=model.named_parameters(),
                                           op=rrt.Adasum)
            x, y = data(c.rank())
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            t = rrt.allreduce(torch.tensor([1.0, 0.0]) if c.rank() == 0
                              else torch.tensor([0.0, 1.0]), op=rrt.Adasum)
            return {k: v.detach().clone() for k, v in model.state_dict().items()}, t

    res = run_threaded(n, fn, timeout=60)
    # Reference: each rank's local SGD change, combined per parameter with Adasum.
    deltas = []
    for r in range(n):
        model = make()
        x, y = data(r)
        torch.nn.functional.mse_loss(model(x), y).backward()
        deltas.append({k: -lr * p.grad.double() for k, p in model.named_parameters()})
    start = make().state_dict()
    for k in start:
        want = start[k].double() + torch.from_numpy(
            reference([d[k].numpy().ravel() for d in deltas])).view(start[k].shape)
        for state, _ in res:
            torch.testing.assert_close(state[k], want.float(), rtol=1e-5, atol=1e-6)
    want_t = reference([[1.0, 0.0]] + [[0.0, 1.0]] * (n - 1))  # [0.75, 1.25]
    for _, t in res:
        torch.testing.assert_close(t, torch.tensor(want_t, dtype=torch.float32))
