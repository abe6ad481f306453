"""Adasum (op=Adasum): the numpy and torch allreduce, and DistributedOptimizer's delta
form, against a float64 reference of the recursive pairwise formula written here."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from procs import run_env_launch

import ringreduce as rr
from ringreduce._dtypes import dtype_code
from ringreduce.testing import make_world, run_threaded


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


@pytest.mark.parametrize("n", [3, 4])  # gather path, engine path
def test_torch_adasum_allreduce_and_optimizer(n):
    torch = pytest.importorskip("torch")
    import ringreduce.torch as rrt

    lr = 0.1

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
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            assert (c._engine.stats()["adasum_allreduces"] == 2) == (n == 4)  # step + t
            return state, t

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


# ---------------------------------------------------------------- the engine's Adasum
# Power-of-two sets run csrc/collectives/allreduce_adasum.cc (vector halving, distance
# doubling); the stat adasum_allreduces counts its runs. Tolerances: the engine rounds
# to the element type after each level, the reference is float64 throughout.

TOL = {np.float16: 5e-3, ml_dtypes.bfloat16: 2e-2, np.float32: 2e-6, np.float64: 1e-12}
BIG = (1 << 20) // 4 + 3  # float32 elements past one 1 MiB transport chunk, odd


def tensors(rank, dtype, big):
    """A fused call's tensors on ``rank``: empty, one element, odd and not divisible by 4
    sizes, norms 1e3 apart, zero everywhere, zero on even ranks, and optionally more
    than one transport chunk."""
    rng = np.random.default_rng(100 + rank)
    xs = [np.zeros(0), rng.standard_normal(1), rng.standard_normal(13) * 1000,
          rng.standard_normal(7) * 0.001, np.zeros(6),
          rng.standard_normal(5) * (rank % 2), rng.standard_normal(33)]
    if big:
        xs.append(rng.standard_normal(BIG))
    return [x.astype(dtype) for x in xs]


def adasum_runs(c):
    return c._engine.stats()["adasum_allreduces"]


def close_to(got, want, dtype):
    """Within the dtype's tolerance of ``want``, relative to its largest element."""
    got = np.asarray(got, np.float64).ravel()
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    assert got.shape == want.shape
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= TOL[dtype] * scale, (err, scale, dtype)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_engine_adasum_matches_the_pairing_per_tensor(n, dtype):
    big = dtype in (np.float16, np.float32)

    def fn(c):
        before = adasum_runs(c)
        xs = tensors(c.rank(), dtype, big)
        grouped = c.grouped_allreduce(xs, op=rr.Adasum, name="g", prescale_factor=2.0,
                                      postscale_factor=0.25)
        inplace = [x.copy() for x in xs]
        c.grouped_allreduce_async_(inplace, op=rr.Adasum).wait()
        one = c.allreduce(xs[2], op=rr.Adasum, name="one", prescale_factor=2.0,
                          postscale_factor=0.5)
        return grouped, inplace, one, adasum_runs(c) - before

    res = run_threaded(n, fn, timeout=60)
    every = [tensors(r, dtype, big) for r in range(n)]
    for grouped, inplace, one, runs in res:
        assert runs == 3  # each call one engine Adasum (a group is one fused response)
        for i, got in enumerate(grouped):
            assert got.dtype == np.dtype(dtype)
            want = reference([2.0 * e[i].astype(np.float64) for e in every]) * 0.25
            close_to(got, want, dtype)
            close_to(inplace[i], reference([e[i].astype(np.float64) for e in every]), dtype)
        close_to(one, reference([2.0 * e[2].astype(np.float64) for e in every]) * 0.5, dtype)
        for mine, first in zip(grouped + inplace + [one], res[0][0] + res[0][1] + [res[0][2]]):
            assert mine.tobytes() == first.tobytes()  # bitwise the same on every rank


def test_engine_adasum_dots_are_per_tensor():
    """Two tensors fused in one buffer: combined as one vector, the large one would set the
    coefficients of the small one. Equal vectors average, orthogonal ones add, per tensor."""

    def fn(c):
        big = np.array([1000.0, 0.0]) if c.rank() == 0 else np.array([0.0, 1000.0])
        same = np.array([2.0, 4.0, 6.0])
        return c.grouped_allreduce([big, same], op=rr.Adasum), adasum_runs(c)

    for (big, same), runs in run_threaded(2, fn, timeout=60):
        assert runs == 1
        np.testing.assert_allclose(big, [1000.0, 1000.0])
        np.testing.assert_allclose(same, [2.0, 4.0, 6.0])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_engine_adasum_of_nothing_and_of_one_rank(n):
    def fn(c):
        empty = c.allreduce(np.zeros(0, np.float32), op=rr.Adasum, name="empty")
        group = c.grouped_allreduce([np.zeros((0, 3)), np.zeros(0)], op=rr.Adasum, name="g")
        x = np.arange(5.0) + c.rank()
        return empty, group, c.allreduce(x, op=rr.Adasum, postscale_factor=3.0), adasum_runs(c)

    for empty, group, x, runs in run_threaded(n, fn, timeout=60):
        assert empty.shape == (0,) and [g.shape for g in group] == [(0, 3), (0,)]
        assert runs == 3
        want = reference([np.arange(5.0) + r for r in range(n)]) * 3.0
        np.testing.assert_allclose(x, want, rtol=1e-12)


def test_three_ranks_gather_instead():
    def fn(c):
        x = contribution(c.rank(), (9,), np.float64)
        return c.allreduce(x, op=rr.Adasum), adasum_runs(c)

    want = reference([contribution(r, (9,), np.float64) for r in range(3)])
    for out, runs in run_threaded(3, fn, timeout=60):
        assert runs == 0
        np.testing.assert_allclose(out, want, rtol=1e-12)


def test_engine_adasum_mismatched_op_and_refused_dtypes():
    def fn(c):
        op = rr.Adasum if c.rank() == 0 else rr.Sum
        with pytest.raises(rr.MismatchError, match="Adasum"):
            c.allreduce(np.ones(4, np.float32), op=op, name="m")
        # Straight to the engine (no Python check first): its own refusal names the tensor.
        x = np.ones(3, np.int32)
        code = dtype_code(x.dtype, "allreduce")
        with pytest.raises(rr.InvalidInputError, match="'ints'.*floating-point"):
            c._engine.allreduce(x, x, [3], code, rr.Adasum, 1.0, 1.0, "ints")
        return float(c.allreduce(np.ones(2), op=rr.Adasum, name="after")[0])

    assert run_threaded(2, fn, timeout=60) == [1.0, 1.0]


def test_engine_adasum_on_process_sets():
    from ringreduce import ProcessSet

    def fn(c):
        sets = [ProcessSet([0, 2]), ProcessSet([1, 3])]
        c.process_sets.setup(sets)
        mine = sets[c.rank() % 2]
        with rr.use_communicator(c):
            before = adasum_runs(c)
            out = rr.allreduce(contribution(c.rank(), (11,), np.float64), op=rr.Adasum,
                               name="ps", process_set=mine)
            return out, adasum_runs(c) - before

    res = run_threaded(4, fn, timeout=60)
    for r, (out, runs) in enumerate(res):
        assert runs == 1
        pair = [r % 2, r % 2 + 2]
        want = reference([contribution(p, (11,), np.float64) for p in pair])
        np.testing.assert_allclose(out, want, rtol=1e-12)


def test_engine_adasum_with_a_joined_rank_counts_it_as_zero():
    """Rank 1 has joined: its leaf of the pairing is a zero vector, which Adasum passes
    through, so the result is adasum(v0, adasum(v2, v3)) (documented in _adasum.py)."""

    def fn(c):
        if c.rank() == 1:
            return c.join(), None
        out = c.allreduce(contribution(c.rank(), (6,), np.float64), op=rr.Adasum, name="j")
        return c.join(), out

    res = run_threaded(4, fn, timeout=60)
    vs = [contribution(r, (6,), np.float64) for r in range(4)]
    want = reference([vs[0], np.zeros(6), vs[2], vs[3]])
    for r, (_, out) in enumerate(res):
        if r != 1:
            np.testing.assert_allclose(out, want, rtol=1e-12)


def test_engine_adasum_in_processes():
    """Two processes (env-var launch): a large allreduce and a fused group run the engine's
    Adasum (the worker checks results and the stat)."""
    job = run_env_launch(2, "adasum_worker.py", timeout=120)
    job.check_ok(expect_ranks=2)


def test_engine_adasum_over_tcp_and_shm():
    """Two "hosts" of two ranks: level 0 pairs over shm, level 1 over TCP."""
    w = make_world(4, host_ids=["a", "a", "b", "b"])
    count = 70_001

    def fn(c):
        x = contribution(c.rank(), (count,), np.float64)
        return c.allreduce(x, op=rr.Adasum, name="x"), adasum_runs(c)

    try:
        res = run_threaded(4, fn, world=w, timeout=60)
    finally:
        for c in w:
            c.close()
    want = reference([contribution(r, (count,), np.float64) for r in range(4)])
    for out, runs in res:
        assert runs == 1 and out.tobytes() == res[0][0].tobytes()
        np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-12)
