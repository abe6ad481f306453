"""ringreduce.torch.DistributedOptimizer and friends, with ranks as threads (fast).

The central check is equivalence: N ranks with per-rank batch B/N end with the
same parameters as one process with batch B, for several optimizers and steps.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.testing import make_world, run_threaded  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True, params=["buckets", "no-buckets"])
def gradient_path(request, monkeypatch):
    """Every test runs on both paths: gradients as views of shared buckets (the default)
    and as the tensors autograd allocates."""
    monkeypatch.setenv("RINGREDUCE_GRADIENT_BUCKETS", "1" if request.param == "buckets" else "0")
    return request.param


def run(n, fn, timeout=60):
    """Run fn(rank) on n threaded ranks with ringreduce.torch routed to each rank's comm."""

    def body(c):
        with rrt.use_communicator(c):
            return fn(c.rank())

    return run_threaded(n, body, timeout=timeout)


def engine_reorders() -> bool:
    """True if ranks may submit named collectives in different orders (the background engine)."""
    comms = make_world(2)
    try:
        def body(c):
            names = ["probe.a", "probe.b"] if c.rank() == 0 else ["probe.b", "probe.a"]
            hs = [c.allreduce_async(np.ones(1, np.float32), rr.Sum, n) for n in names]
            return [float(h.wait()[0]) for h in hs]

        out = run_threaded(2, body, world=comms, timeout=20, return_exceptions=True)
        return all(not isinstance(o, BaseException) for o in out)
    except Exception:
        return False
    finally:
        for c in comms:
            c.close()


_REORDERS: list = []


def needs_engine():
    if not _REORDERS:
        _REORDERS.append(engine_reorders())
    if not _REORDERS[0]:
        pytest.skip("needs the background engine (ranks submitting in different orders)")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(2, 2)  # never used in forward

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


_RNG = threading.Lock()  # torch's default RNG is process-wide: threads must not interleave


def seeded(seed, build):
    """``build()`` right after ``torch.manual_seed(seed)``, safe with ranks as threads."""
    with _RNG:
        torch.manual_seed(seed)
        return build()


def make_net(seed=0):
    return seeded(seed, lambda: Net().double())


def wrapped_net(**kw):
    """make_net() and a DistributedOptimizer over SGD(lr=0.1) holding its parameters."""
    model = make_net()
    return model, rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **kw)


def data(steps, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64),
             torch.randn(batch, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


class SignSGD(torch.optim.Optimizer):
    """A custom optimizer with a required extra constructor argument."""

    def __init__(self, params, lr, flavour):
        super().__init__(params, {"lr": lr})
        self.flavour = flavour

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["n"] = state.get("n", 0) + 1
                    p.add_(torch.tanh(p.grad * 100), alpha=-group["lr"])


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "custom": lambda ps: SignSGD(ps, lr=0.01, flavour="x"),
    "groups": lambda ps: torch.optim.SGD(
        [{"params": [p for n, p in ps if n.startswith("fc1")], "lr": 0.05},
         {"params": [p for n, p in ps if not n.startswith("fc1")]}], lr=0.1, momentum=0.5),
}


def train(model, opt, batches, rank, n, **kw):
    for x, y in batches:
        per = x.shape[0] // n
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_opt(kind, model):
    named = list(model.named_parameters())
    return OPTIMIZERS[kind](named if kind == "groups" else model.parameters())


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_np2_matches_np1(kind):
    """np=2 with per-rank batch B/2 == np=1 with batch B, same seed, several steps."""
    base, batches = make_net(), data(steps=5, batch=16)

    def one(n):
        def fn(rank):
            model = copy.deepcopy(base)
            opt = rrt.DistributedOptimizer(make_opt(kind, model),
                                           named_parameters=model.named_parameters())
            return train(model, opt, batches, rank, n)

        return run(n, fn)

    single, (r0, r1) = one(1)[0], one(2)
    plain_model = copy.deepcopy(base)
    plain = train(plain_model, make_opt(kind, plain_model), batches, 0, 1)
    for k in single:
        torch.testing.assert_close(single[k], plain[k], rtol=0, atol=0)  # np=1 adds nothing
        assert torch.equal(r0[k], r1[k]), f"{k} differs between ranks"
        torch.testing.assert_close(r0[k], single[k], rtol=1e-9, atol=1e-11)
        if "unused" in k:
            assert torch.equal(r0[k], base.state_dict()[k]), "unused parameter was updated"
    assert not torch.equal(r0["fc1.weight"], base.state_dict()["fc1.weight"])


def test_gradient_accumulation_matches_big_batch():
    """backward_passes_per_step=2 with half batches == one pass over the whole batch."""
    base, batches = make_net(), data(steps=3, batch=16)

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=2)
        for x, y in batches:
            opt.zero_grad()
            mine = slice(rank * 8, (rank + 1) * 8)
            for half in (slice(0, 4), slice(4, 8)):
                xs, ys = x[mine][half], y[mine][half]
                (torch.nn.functional.mse_loss(model(xs), ys) / 2).backward()
            opt.step()
        return model.state_dict()

    out = run(2, fn)
    plain = copy.deepcopy(base)
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), batches, 0, 1)
    for k in want:
        torch.testing.assert_close(out[0][k], want[k], rtol=1e-9, atol=1e-12)
        assert torch.equal(out[0][k], out[1][k])


def test_too_many_backward_passes_is_reported():
    def fn(rank):
        model, opt = wrapped_net()
        x = torch.ones(2, 6, dtype=torch.float64)
        model(x).sum().backward()
        with pytest.raises(rr.InvalidInputError, match="more than backward_passes_per_step"):
            model(x).sum().backward()
        # That backward pass added to a gradient whose allreduce was running.
        with pytest.raises(rr.InvalidInputError, match="changed in place"):
            opt.step()
        opt.zero_grad()  # and the optimizer is usable again
        model(x).sum().backward()
        opt.step()
        return True

    assert run(2, fn) == [True, True]


@pytest.mark.parametrize("compression, rtol", [("fp16", 2e-3), ("bf16", 1.6e-2)])
def test_compression(compression, rtol):
    """Gradients travel as fp16/bf16 and come back in the parameter dtype, close to exact."""
    base = make_net().float()
    x = torch.randn(8, 6)

    def fn(rank, comp):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(),
                                       compression=getattr(rrt.Compression, comp))
        model(x[rank * 4:(rank + 1) * 4]).pow(2).mean().backward()
        opt.synchronize()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with opt.skip_synchronize():
            opt.step()
        return grads

    exact = run(2, lambda r: fn(r, "none"))[0]
    got = run(2, lambda r: fn(r, compression))
    for k, g in exact.items():
        assert got[0][k].dtype == torch.float32
        assert torch.equal(got[0][k], got[1][k])
        torch.testing.assert_close(got[0][k], g, rtol=rtol, atol=rtol * g.abs().max().item())


def test_compressors_pass_integers_and_narrow_floats_through():
    for comp in (rrt.Compression.fp16, rrt.Compression.bf16):
        for t in (torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.float16)):
            sent, ctx = comp.compress(t)
            assert sent is t and comp.decompress(sent, ctx) is t
    sent, ctx = rrt.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert sent.dtype == torch.float16
    assert rrt.Compression.fp16.decompress(sent, ctx).dtype == torch.float64


def test_parameters_unused_on_every_rank_keep_no_gradient():
    def fn(rank):
        model = make_net()
        opt = rrt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        before = model.unused.weight.detach().clone()
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
            opt.step()
        return model.unused.weight.grad, torch.equal(before, model.unused.weight)

    for grad, unchanged in run(2, fn):
        assert grad is None and unchanged


def test_parameter_used_on_some_ranks_only():
    """Rank 1 never touches fc2; rank 0 does: both must finish with the averaged gradient."""
    needs_engine()

    def fn(rank):
        model, opt = wrapped_net()
        x = torch.full((2, 6), 1.0, dtype=torch.float64)
        out = model(x).sum() if rank == 0 else model.fc1(x).sum()
        out.backward()
        opt.synchronize()
        grad = model.fc2.weight.grad.clone()
        with opt.skip_synchronize():
            opt.step()
        return grad

    g0, g1 = run(2, fn)
    assert torch.equal(g0, g1) and g0.abs().sum() > 0


def test_zero_grad_between_backward_and_step_is_reported():
    def fn(rank):
        model, opt = wrapped_net()
        model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
        with pytest.raises(rr.InvalidInputError, match="zero_grad.*before step") as info:
            opt.zero_grad()
        assert "grad.fc1.weight" in str(info.value)
        opt.step()  # still consistent afterwards
        opt.zero_grad()
        return True

    assert run(2, fn) == [True, True]


def test_model_zero_grad_between_backward_and_step_is_reported():
    def fn(rank):
        model, opt = wrapped_net()
        model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
        model.zero_grad()
        with pytest.raises(rr.InvalidInputError, match="replaced or set to None"):
            opt.step()
        return True

    assert run(2, fn) == [True, True]


def test_named_parameters_duplicates_and_missing_are_reported():
    model = make_net()
    rrt.init()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dup = [("w", model.fc1.weight), ("w", model.fc1.bias)]
        with pytest.raises(rr.InvalidInputError, match="duplicate names 'w'"):
            rrt.DistributedOptimizer(opt, named_parameters=dup)
        with pytest.raises(rr.InvalidInputError, match="does not name 4 of the optimizer's 6"):
            rrt.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:2])
        with pytest.raises(rr.InvalidInputError, match=r"\(name, tensor\) pairs"):
            rrt.DistributedOptimizer(opt, named_parameters=model.parameters())
        with pytest.raises(rr.InvalidInputError, match="backward_passes_per_step"):
            rrt.DistributedOptimizer(opt, backward_passes_per_step=0)
        with pytest.raises(rr.InvalidInputError, match="predivide"):
            rrt.DistributedOptimizer(opt, op=rrt.Sum, gradient_predivide_factor=2.0)
        dist = rrt.DistributedOptimizer(opt)
        with pytest.raises(rr.InvalidInputError, match="already a DistributedOptimizer"):
            rrt.DistributedOptimizer(dist)
    finally:
        rrt.shutdown()


def test_ranks_with_different_models_are_reported():
    def fn(rank):
        model = seeded(0, lambda: torch.nn.Linear(3, 2 + rank))
        rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())

    errors = run_threaded(2, lambda c: _with(c, fn), return_exceptions=True)
    for err in errors:
        assert isinstance(err, rr.InvalidInputError), err
        assert "rank 1" in str(err) and "'grad.weight'" in str(err)


def _with(c, fn):
    with rrt.use_communicator(c):
        return fn(c.rank())


def test_synchronize_clip_then_step():
    """synchronize() + clipping + skip_synchronize(): step applies the clipped average."""
    base = make_net()

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters())
        model(torch.full((2, 6), rank + 1.0, dtype=torch.float64)).sum().backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with opt.skip_synchronize():
                opt.step()
        return {n: before[n] - p.detach() for n, p in model.named_parameters()}, clipped

    (d0, c0), (d1, c1) = run(2, fn)
    total = torch.sqrt(sum((g ** 2).sum() for g in c0.values()))
    assert abs(total.item() - 0.01) < 1e-7  # clip_grad_norm_ adds 1e-6 to the norm
    for k, g in c0.items():
        torch.testing.assert_close(d0[k], g)
        assert torch.equal(d0[k], d1[k])


def test_step_right_after_synchronize_does_not_reduce_twice():
    """Horovod's warning for this pattern, but no second allreduce."""

    def fn(rank):
        model = make_net()
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters())
        model(torch.full((1, 6), rank + 1.0, dtype=torch.float64)).sum().backward()
        opt.synchronize()
        model.fc2.bias.grad.add_(rank)  # a second allreduce would average this away
        opt.step()
        return model.fc2.bias.grad.clone()

    with pytest.warns(UserWarning, match="skip_synchronize"):
        g0, g1 = run(2, fn)
    assert torch.equal(g1 - g0, torch.ones_like(g0))


def test_lr_scheduler_and_state_dict_round_trip():
    def fn(rank):
        model = make_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = rrt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
            opt.step()
            sched.step()
        assert isinstance(opt, torch.optim.SGD)
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        return opt.param_groups[0]["lr"]

    assert run(2, fn) == [0.025, 0.025]


def test_grad_scaler_with_synchronize():
    def fn(rank):
        model = make_net().float()
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(model(torch.ones(2, 6)).sum()).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        return model.fc2.bias.detach().clone()

    b0, b1 = run(2, fn)
    assert torch.equal(b0, b1)
    torch.testing.assert_close(b0, make_net().fc2.bias.detach().float() - 0.1 * 2)


def test_sparse_gradients():
    def fn(rank, dense):
        emb = seeded(0, lambda: torch.nn.Embedding(10, 3, sparse=True).double())
        opt = rrt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=dense)
        emb(torch.tensor([rank, 5, 5])).sum().backward()
        opt.synchronize()
        assert emb.weight.grad.is_sparse  # sparse_as_dense sends it dense, returns it sparse
        grad = emb.weight.grad.to_dense().clone()
        with opt.skip_synchronize():
            opt.step()
        return grad

    want = torch.zeros(10, 3, dtype=torch.float64)
    want[0] += 0.5
    want[1] += 0.5
    want[5] += 2.0
    for dense in (False, True):
        for g in run(2, lambda r, d=dense: fn(r, d)):
            torch.testing.assert_close(g, want)


def test_sparse_as_dense_with_sparse_adam():
    """SparseAdam needs sparse gradients: sparse_as_dense must hand them back sparse."""

    def fn(rank):
        emb = seeded(0, lambda: torch.nn.Embedding(10, 3, sparse=True))
        opt = rrt.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=True)
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([rank, 5])).sum().backward()
            opt.step()
        return emb.weight.detach().clone()

    w0, w1 = run(2, fn)
    assert torch.equal(w0, w1)
    assert not torch.equal(w0[5], seeded(0, lambda: torch.nn.Embedding(10, 3)).weight[5])


def test_sparse_gradient_missing_on_one_rank():
    """Rank 1 never uses the embedding: it has no gradient, and must contribute an empty
    sparse one to the others' allgathers rather than a dense zero that nobody matches."""

    def fn(rank, dense):
        emb = seeded(0, lambda: torch.nn.Embedding(10, 3, sparse=True).double())
        lin = seeded(1, lambda: torch.nn.Linear(3, 1).double())
        params = [("emb." + n, p) for n, p in emb.named_parameters()] + \
            [("lin." + n, p) for n, p in lin.named_parameters()]
        opt = rrt.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0),
                                       named_parameters=params, sparse_as_dense=dense)
        x = emb(torch.tensor([2, 5])) if rank == 0 else torch.ones(2, 3, dtype=torch.float64)
        lin(x).sum().backward()
        opt.synchronize()
        grad = emb.weight.grad.to_dense().clone()
        with opt.skip_synchronize():
            opt.step()
        return grad, emb.weight.detach().clone()

    want = torch.zeros(10, 3, dtype=torch.float64)
    want[[2, 5]] = seeded(1, lambda: torch.nn.Linear(3, 1).double()).weight.detach() / 2
    for dense in (False, True):
        (g0, w0), (g1, w1) = run(2, lambda r, d=dense: fn(r, d), timeout=60)
        torch.testing.assert_close(g0, want)
        torch.testing.assert_close(g1, want)
        assert torch.equal(w0, w1)


def test_two_optimizers_with_the_same_parameter_names():
    """A GAN-like pair: both models have parameters called '0.weight'."""

    def fn(rank):
        gen, disc = seeded(0, lambda: (torch.nn.Sequential(torch.nn.Linear(2, 2)),
                                       torch.nn.Sequential(torch.nn.Linear(2, 1))))
        og = rrt.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                      named_parameters=gen.named_parameters())
        od = rrt.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                      named_parameters=disc.named_parameters())
        disc(gen(torch.full((1, 2), float(rank)))).sum().backward()
        od.step()
        og.step()
        return gen[0].weight.detach().clone()

    w0, w1 = run(2, fn)
    assert torch.equal(w0, w1)


# ----------------------------------------------------------------- broadcasts
def test_broadcast_parameters_state_dict_and_named_parameters():
    def fn(rank):
        model = seeded(rank, lambda: torch.nn.Sequential(torch.nn.Linear(3, 4),
                                                         torch.nn.BatchNorm1d(4)))
        model(seeded(rank, lambda: torch.randn(5, 3)))  # running stats differ per rank too
        model[0].weight.data = model[0].weight.data.t().contiguous().t()  # non-contiguous
        rrt.broadcast_parameters(model.state_dict(), root_rank=1)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        other = seeded(10 + rank, lambda: torch.nn.Linear(2, 2))
        rrt.broadcast_parameters(other.named_parameters(), root_rank=0)
        third = seeded(20 + rank, lambda: torch.nn.Linear(2, 3))
        rrt.broadcast_parameters(list(third.parameters()), root_rank=1)  # Horovod's list form
        return sd, other.weight.detach().clone(), third.bias.detach().clone()

    (s0, w0, b0), (s1, w1, b1) = run(2, fn)
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    assert torch.equal(w0, w1)
    assert torch.equal(b0, b1) and torch.equal(b0, seeded(21, lambda: torch.nn.Linear(2, 3)).bias)
    ref = seeded(1, lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    assert torch.equal(s0["0.weight"], ref[0].weight.detach())


def test_broadcast_parameters_mismatch_is_reported_everywhere():
    def fn(rank):
        rrt.broadcast_parameters({"w": torch.zeros(2 + rank)}, root_rank=0)

    errors = run_threaded(2, lambda c: _with(c, fn), return_exceptions=True)
    for err in errors:
        assert isinstance(err, rr.InvalidInputError) and "'w'" in str(err), err


@pytest.mark.parametrize("kind", ["adam", "sgd", "custom", "groups"])
def test_broadcast_optimizer_state(kind):
    """Root's state, step counts and hyper-parameters reach every rank, also when empty."""

    def fn(rank):
        model = make_net()
        plain = make_opt(kind, model)
        plain.param_groups[0]["lr"] = 0.5 if rank == 0 else 0.25
        rrt.broadcast_optimizer_state(plain, root_rank=0)  # empty state everywhere
        empty = (len(plain.state), plain.param_groups[0]["lr"])
        if rank == 0:  # only rank 0 builds state (plain steps: no collectives)
            for _ in range(2):
                model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
                plain.step()
        opt = rrt.DistributedOptimizer(plain, named_parameters=model.named_parameters())
        rrt.broadcast_optimizer_state(opt, root_rank=0)
        return empty, opt.state_dict()

    (e0, sd0), (e1, sd1) = run(2, fn)
    assert e0 == e1 == (0, 0.5)
    assert sd0["param_groups"] == sd1["param_groups"]
    assert sd0["state"].keys() == sd1["state"].keys()
    for i, st in sd0["state"].items():
        for k, v in st.items():
            other = sd1["state"][i][k]
            assert torch.equal(v, other) if isinstance(v, torch.Tensor) else v == other


def test_broadcast_optimizer_state_group_mismatch():
    def fn(rank):
        ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
        opt = torch.optim.SGD([{"params": ps[:1 + rank]}], lr=0.1)
        rrt.broadcast_optimizer_state(opt, root_rank=0)

    errors = run_threaded(2, lambda c: _with(c, fn), return_exceptions=True)
    for err in errors:
        assert isinstance(err, rr.InvalidInputError) and "parameter groups" in str(err), err


# ------------------------------------------------------------- SyncBatchNorm
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)

    def fn(rank):
        bn = rrt.SyncBatchNorm(3).double()
        with torch.no_grad():
            bn.weight.copy_(w)
        xs = x[rank * 4:(rank + 1) * 4].clone().requires_grad_()
        y = bn(xs)
        (y * torch.arange(y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
        grads = rrt.allreduce(torch.cat([bn.weight.grad, bn.bias.grad]), op=rrt.Sum)
        return y.detach(), xs.grad, grads, bn.running_mean.clone(), bn.running_var.clone()

    out = run(2, fn)
    ref = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        ref.weight.copy_(w)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    dy = torch.cat([torch.arange(y[:4].numel(), dtype=torch.float64).view_as(y[:4])] * 2)
    (y * dy).sum().backward()
    torch.testing.assert_close(torch.cat([out[0][0], out[1][0]]), y.detach())
    torch.testing.assert_close(torch.cat([out[0][1], out[1][1]]), xr.grad)
    torch.testing.assert_close(out[0][2], torch.cat([ref.weight.grad, ref.bias.grad]))
    torch.testing.assert_close(out[0][3], ref.running_mean)
    torch.testing.assert_close(out[0][4], ref.running_var)


def test_convert_sync_batchnorm_and_eval_mode():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
    conv = rrt.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(conv[1], rrt.SyncBatchNorm)
    assert conv[1].weight is model[1].weight
    rrt.init()
    try:
        conv.eval()
        x = torch.randn(2, 1, 3, 3)
        torch.testing.assert_close(conv(x), model.eval()(x))
        conv.train()
        model.train()
        torch.testing.assert_close(conv(x), model(x))  # size 1: ordinary batch norm
    finally:
        rrt.shutdown()


def test_a_newer_optimizer_takes_over_the_parameters():
    """Re-wrapping the same parameters: only the newest optimizer reduces them."""

    def fn(rank):
        model = make_net()
        first = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(torch.full((1, 6), float(rank), dtype=torch.float64)).sum().backward()
        assert not first._rr_inflight
        opt.step()
        first.step()  # nothing of its own to reduce: a plain step
        return model.fc1.weight.detach().clone()

    w0, w1 = run(2, fn)
    assert torch.equal(w0, w1)


@pytest.mark.parametrize("order", ["clip, then step", "synchronize, clip, step"])
def test_changing_gradients_in_flight_is_refused(order):
    """Clipping between backward() and step() changes a gradient its allreduce is still
    writing (ranks would end up with different gradients): refused, naming the way out;
    after synchronize() it is the documented recipe and works."""

    def fn(rank):
        model, opt = wrapped_net()
        model(torch.full((1, 6), float(rank + 1), dtype=torch.float64)).sum().backward()
        if order == "clip, then step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            with pytest.raises(rr.InvalidInputError, match="changed in place.*synchronize"):
                opt.step()
            return None
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        with opt.skip_synchronize():
            opt.step()
        return model.fc1.weight.detach().clone()

    out = run(2, fn)
    if order != "clip, then step":
        assert torch.equal(out[0], out[1])


def test_a_parameter_unfrozen_after_wrapping_is_averaged():
    """Gradual unfreezing: fc1 is frozen when the optimizer is wrapped, then unfrozen; from
    then on its gradient is averaged like the others (the ranks see different data)."""

    def fn(rank):
        model = make_net()
        model.fc1.weight.requires_grad_(False)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        x = torch.full((1, 6), float(rank + 1), dtype=torch.float64)
        for unfreeze in (False, True, False):
            if unfreeze:
                model.fc1.weight.requires_grad_(True)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    a, b = run(2, fn)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(a["fc1.weight"], make_net().fc1.weight)


class _Tokens(torch.nn.Module):
    """Parameters concatenated or stacked in forward (DeiT's class tokens, MoE experts):
    autograd hands their gradients out as parts of one buffer, with one version counter."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a = torch.nn.Parameter(torch.arange(4.0).view(1, 4))
        self.b = torch.nn.Parameter(torch.ones(1, 4))

    def forward(self, x):
        if self.how == "cat":
            return (torch.cat([self.a, self.b, x]) ** 2).sum()
        return (torch.stack([self.a, self.b]).sum(0) * x ** 2).sum()


@pytest.mark.parametrize("how", ["cat", "stack"])
@pytest.mark.parametrize("mode", ["fp16", "k2", "keep-grads"])
def test_gradients_sharing_a_buffer_are_not_taken_for_changed_ones(how, mode):
    """Their shared version counter moves when a sibling is accumulated or copied back;
    that is no in-place change by the user, and the steps must run and agree."""

    def fn(rank):
        m = _Tokens(how)
        kw = {"compression": rrt.Compression.fp16} if mode == "fp16" else {}
        passes = 2 if mode == "k2" else 1
        opt = rrt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(),
                                       backward_passes_per_step=passes, **kw)
        for step in range(3):
            opt.zero_grad(set_to_none=mode != "keep-grads")
            for _ in range(passes):
                m(torch.full((1, 4), float(rank + step))).backward()
            opt.step()
        return m.a.detach().clone(), m.b.detach().clone()

    (a0, b0), (a1, b1) = run(2, fn)
    assert torch.equal(a0, a1) and torch.equal(b0, b1)


def test_rewrapping_leaves_one_hook_per_parameter():
    """Each newer optimizer replaces the older one's hook (they must not pile up)."""

    def fn(rank):
        model = make_net()
        opts = [rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
                for _ in range(4)]
        hooks = model.fc1.weight._post_accumulate_grad_hooks
        return len(hooks), len(opts)

    assert run(2, fn) == [(1, 4)] * 2


def test_a_wrapped_model_can_still_be_saved_whole():
    """torch.save(model) / pickle of a model whose parameters a DistributedOptimizer holds
    (nothing of ringreduce's may sit on the parameters)."""
    import io
    import pickle

    def fn(rank):
        model, opt = wrapped_net()
        model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        buf = io.BytesIO()
        torch.save(model, buf)
        clone = pickle.loads(pickle.dumps(model))
        return torch.equal(clone.fc1.weight, model.fc1.weight) and buf.tell() > 0

    assert run(2, fn) == [True, True]


# ------------------------------------------------------------------- join()
def join_reference(kind, base, per_rank):
    """Plain training where step s averages the gradients of the ranks that still have data.

    Returns the parameters after every step (index s: after s steps).
    """
    model = copy.deepcopy(base)
    opt = make_opt(kind, model)
    after = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for s in range(max(len(b) for b in per_rank)):
        active = [b[s] for b in per_rank if s < len(b)]
        opt.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in active) / len(active)
        loss.backward()
        opt.step()
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return after


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_join_with_uneven_data(kind):
    """Ranks with 4, 2 and 3 batches: a rank out of data joins; the others' steps average
    over the ranks that still have data only, and nobody hangs."""
    needs_engine()
    base = make_net()
    counts = [4, 2, 3]
    per_rank = [data(steps=c, batch=3, seed=10 + r) for r, c in enumerate(counts)]

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(make_opt(kind, model),
                                       named_parameters=model.named_parameters())
        for x, y in per_rank[rank]:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        at_join = {k: v.detach().clone() for k, v in model.state_dict().items()}
        last = rrt.join()
        rrt.broadcast_parameters(model.state_dict(), root_rank=last)
        rrt.broadcast_optimizer_state(opt, root_rank=last)
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return last, at_join, final, opt.state_dict()

    out = run(3, fn)
    want = join_reference(kind, base, per_rank)
    for rank, (last, at_join, final, sd) in enumerate(out):
        assert last == 0  # rank 0 has the most batches: it joins last
        for k in want[-1]:
            torch.testing.assert_close(at_join[k], want[counts[rank]][k], rtol=1e-9,
                                       atol=1e-12, msg=f"rank {rank} {k}")
            assert torch.equal(final[k], out[0][2][k])
        assert sd["state"].keys() == out[0][3]["state"].keys()
    assert not torch.equal(want[-1]["fc1.weight"], want[2]["fc1.weight"])


@pytest.mark.parametrize("dense", [False, True])
def test_join_sparse_gradients_average_over_contributing_ranks(dense):
    needs_engine()

    def fn(rank):
        emb = seeded(0, lambda: torch.nn.Embedding(10, 3, sparse=True).double())
        opt = rrt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=dense)
        grads = []
        for step in range(2 if rank == 0 else 1):
            opt.zero_grad()
            emb(torch.tensor([rank + step, 5])).sum().backward()
            opt.synchronize()
            grads.append(emb.weight.grad.to_dense().clone())
            with opt.skip_synchronize():
                opt.step()
        return grads, rrt.join()

    (g0, last0), (g1, last1) = run(2, fn)
    assert last0 == last1 == 0
    want = [torch.zeros(10, 3, dtype=torch.float64) for _ in range(2)]
    want[0][0] += 0.5
    want[0][1] += 0.5
    want[0][5] += 1.0
    want[1][1] += 1.0  # step 2: rank 1 has joined, the average is rank 0's gradient
    want[1][5] += 1.0
    torch.testing.assert_close(g0[0], want[0])
    torch.testing.assert_close(g1[0], want[0])
    torch.testing.assert_close(g0[1], want[1])


# ----------------------------------------------------------- step(closure)
def test_step_with_closure_matches_big_batch_and_returns_the_loss():
    base, batches = make_net(), data(steps=3, batch=8)

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        losses = []
        for x, y in batches:
            xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]

            def closure(xs=xs, ys=ys):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xs), ys)
                loss.backward()
                return loss

            with torch.no_grad():  # the closure still runs with grad enabled
                losses.append(opt.step(closure).item())
        return model.state_dict(), losses

    out = run(2, fn)
    plain = copy.deepcopy(base)
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), batches, 0, 1)
    for k in want:
        torch.testing.assert_close(out[0][0][k], want[k], rtol=1e-9, atol=1e-12)
        assert torch.equal(out[0][0][k], out[1][0][k])
    model = copy.deepcopy(base)
    x, y = batches[0]
    for rank in range(2):  # the first loss is this rank's own loss before any step
        own = torch.nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4]),
                                           y[rank * 4:(rank + 1) * 4]).item()
        assert out[rank][1][0] == pytest.approx(own, rel=1e-12)


def test_step_closure_evaluated_twice_is_refused():
    def fn(rank):
        model = make_net()
        opt = rrt.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=3),
                                       named_parameters=model.named_parameters())

        def closure():
            opt.zero_grad()
            loss = model(torch.ones(2, 6, dtype=torch.float64)).pow(2).sum()
            loss.backward()
            return loss

        with pytest.raises(rr.InvalidInputError, match="more than once per step"):
            opt.step(closure)
        return True

    assert run(2, fn) == [True, True]


def test_scheduler_made_before_wrapping_and_state_dict_round_trip():
    """Horovod order is wrap-then-schedule, but a scheduler made on the plain optimizer
    first must keep working (no spurious warning), also after load_state_dict()."""

    def fn(rank):
        model = make_net()
        plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
        opt = rrt.DistributedOptimizer(plain, named_parameters=model.named_parameters(),
                                       num_groups=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                opt.zero_grad()
                model(torch.full((1, 6), rank + 1.0, dtype=torch.float64)).sum().backward()
                opt.step()
                sched.step()
        sd = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(sd)
        sched.step()  # reaches the loaded param groups through the plain optimizer
        other = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        other.load_state_dict(opt.state_dict())  # a plain optimizer takes the state too
        return opt.param_groups[0]["lr"], other.state_dict(), sd

    for lr, other, sd in run(2, fn):
        assert lr == pytest.approx(0.0125)
        assert other["param_groups"][0]["lr"] == pytest.approx(0.0125)
        assert other["state"].keys() == sd["state"].keys() and len(sd["state"]) == 4
        for i, st in sd["state"].items():
            assert torch.equal(other["state"][i]["momentum_buffer"], st["momentum_buffer"])


def test_accumulation_with_horovod_zero_grad_timing():
    """Horovod's accumulation loop: backward every batch, step + zero_grad every k-th."""
    base, batches = make_net(), data(steps=4, batch=8)

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=2)
        for i, (x, y) in enumerate(batches):
            xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            (torch.nn.functional.mse_loss(model(xs), ys) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
        return model.state_dict()

    out = run(2, fn)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(out[0][k], v, rtol=1e-9, atol=1e-12)
        assert torch.equal(out[0][k], out[1][k])


def test_a_dropped_model_and_optimizer_are_freed():
    """The hooks torch keeps on each parameter must not keep the parameter (nor its
    optimizer) alive: a cycle through torch's C++ hook storage is never collected."""
    import gc
    import weakref

    def fn(rank):
        model, opt = wrapped_net()
        model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        refs = [weakref.ref(model.fc1.weight), weakref.ref(opt)]
        del model, opt
        gc.collect()
        return [r() is None for r in refs]

    assert run(2, fn) == [[True, True]] * 2


def test_a_step_keeps_no_gradient_alive():
    """After step(), the gradients that were averaged are the model's alone: once
    zero_grad() drops them, nothing in ringreduce holds them (without gradient buckets;
    with them, the optimizer keeps its buckets by design)."""
    import gc
    import weakref

    def fn(rank):
        model, opt = wrapped_net(gradient_buckets=False)
        model(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
        opt.step()
        # The storages: the numpy views the allreduces ran on share them, not the tensors.
        refs = [weakref.ref(p.grad.untyped_storage()) for p in model.parameters()
                if p.grad is not None]
        opt.zero_grad(set_to_none=True)
        gc.collect()
        return len(refs) > 0 and all(r() is None for r in refs)

    assert run(2, fn) == [True, True]


class _Interrupting:
    """A handle whose wait() is interrupted (Ctrl-C) after the collective completed."""

    def __init__(self, handle):
        self.handle = handle

    def wait(self):
        self.handle.wait()
        raise KeyboardInterrupt

    def done(self):
        return self.handle.done()


def _interrupt_in_wait(opt):
    opt._rr_inflight[0].handle = _Interrupting(opt._rr_inflight[0].handle)


def _interrupt_in_presence(opt):
    real = opt._rr_presence

    def interrupted(slots):
        real(slots)  # both ranks take part, then the interrupt lands
        raise KeyboardInterrupt

    opt._rr_presence = interrupted


@pytest.mark.parametrize("where", [_interrupt_in_wait, _interrupt_in_presence])
def test_an_interrupted_step_leaves_the_optimizer_usable(where):
    """Ctrl-C while step() waits for a gradient, or in its presence allreduce (after the
    hooks submitted every gradient): the next steps run normally."""

    def fn(rank):
        model, opt = wrapped_net()
        x = torch.full((1, 6), float(rank + 1), dtype=torch.float64)
        model(x).sum().backward()
        where(opt)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        opt.__dict__.pop("_rr_presence", None)
        assert not opt._rr_inflight
        time.sleep(0.2)  # dropped allreduces finish in the engine
        grads = []
        for _ in range(2):  # steps after the interrupt: no stale in-flight state
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            grads.append(model.fc1.weight.grad.clone())
        return grads

    g0, g1 = run(2, fn)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b)  # averaged: the same on both ranks


@pytest.mark.parametrize("factor", [float("inf"), 1e-320, float("nan"), 0.0, "2"])
def test_predivide_factor_must_give_finite_scales(factor):
    model = make_net()
    rrt.init()
    try:
        with pytest.raises(rr.InvalidInputError, match="gradient_predivide_factor"):
            rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     gradient_predivide_factor=factor)
    finally:
        rrt.shutdown()
