"""DistributedOptimizer's gradient buckets: the gradients are views of one shared buffer
per dtype, and stay so through what training scripts do; where a script breaks the
layout, that gradient takes the ordinary path and is counted (never a wrong result).
(Every test of test_torch_optimizer*.py and test_torch_broadcasts_and_syncbn.py also runs with
and without buckets.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402

torch.set_num_threads(1)


def run(n, fn):
    def body(c):
        with rrt.use_communicator(c):
            return fn(c.rank())

    return run_threaded(n, body, timeout=60)


def net():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model.double()


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g, dtype=torch.float64)


def in_bucket(opt, p):
    return opt._rr_buckets is not None and opt._rr_buckets.holds(p.grad)


def train(rank, buckets, script, steps=3):
    model = net()
    opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   gradient_buckets=buckets,
                                   backward_passes_per_step=2 if script is accumulate_step else 1)
    for step in range(steps):
        script(model, opt, batch(rank, step))
    return [p.detach().clone() for p in model.parameters()], opt


def plain_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def keep_zeros_step(model, opt, x):
    opt.zero_grad(set_to_none=False)
    model(x).pow(2).sum().backward()
    opt.step()


def model_zero_grad_step(model, opt, x):
    model.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def clip_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()


def accumulate_step(model, opt, x):
    opt.zero_grad()
    for half in (x[:2], x[2:]):
        model(half).pow(2).sum().backward()
    opt.step()


SCRIPTS = {"zero_grad": plain_step, "set_to_none=False": keep_zeros_step,
           "model.zero_grad": model_zero_grad_step, "clip": clip_step,
           "accumulate": accumulate_step}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_buckets_hold_the_gradients_and_match_the_plain_path(script):
    def fn(rank):
        with_buckets, opt = train(rank, True, SCRIPTS[script])
        plain, _ = train(rank, False, SCRIPTS[script])
        return with_buckets, plain, opt.bucket_stats(), all(
            in_bucket(opt, p) for p in opt.param_groups[0]["params"])

    for with_buckets, plain, stats, held in run(2, fn):
        assert held and stats["buckets"] == 1 and stats["fallbacks"] == 0, stats
        for a, b in zip(with_buckets, plain):
            assert torch.equal(a, b)


def test_a_gradient_replaced_by_hand_falls_back_and_is_counted():
    def fn(rank):
        model = net()
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        w = model[0].weight
        w.grad = torch.full_like(w, float(rank))  # the user's own tensor: not a view
        model(batch(rank, 0)).sum().backward()
        opt.step()
        return w.grad.clone(), opt.bucket_stats()["fallbacks"], in_bucket(opt, model[2].weight)

    (g0, f0, ok0), (g1, f1, ok1) = run(2, fn)
    assert torch.equal(g0, g1) and f0 == f1 == 1 and ok0 and ok1


def test_changed_in_place_between_backward_and_step_is_refused():
    def fn(rank):
        model = net()
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(batch(rank, 0)).sum().backward()
        model[0].weight.grad.mul_(2.0)  # clipping without synchronize() first
        with pytest.raises(rr.InvalidInputError, match="changed in place"):
            opt.step()
        return True

    assert run(2, fn) == [True, True]


def test_buckets_are_off_with_compression_and_for_sparse_gradients():
    def fn(rank):
        model = net()
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=rrt.Compression.fp16)
        emb = torch.nn.Embedding(5, 3, sparse=True).double()
        opt2 = rrt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                        named_parameters=emb.named_parameters())
        emb(torch.tensor([rank])).sum().backward()
        opt2.step()
        return opt.bucket_stats()["buckets"], emb.weight.grad.is_sparse, \
            opt2.bucket_stats()["fallbacks"]

    assert run(2, fn) == [(0, True, 0)] * 2


def test_environment_switch_turns_buckets_off(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_GRADIENT_BUCKETS", "0")

    def fn(rank):
        _, opt = train(rank, None, plain_step, steps=1)
        return opt.bucket_stats()["buckets"]

    assert run(2, fn) == [0, 0]


def test_bucketed_gradients_take_the_shared_path():
    """The point of the buckets: the engine reduces the gradients where they lie."""

    def fn(rank):
        c = rr._comm()
        before = c._engine.stats()["shared_allreduces"]
        # 5 MiB of gradients: past RINGREDUCE_SHARED_MIN_BYTES (4 MiB)
        model = torch.nn.Linear(1024, 640).double()
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(torch.ones(2, 1024, dtype=torch.float64)).sum().backward()
        opt.step()
        return c._engine.stats()["shared_allreduces"] - before

    assert all(n >= 1 for n in run(2, fn))
