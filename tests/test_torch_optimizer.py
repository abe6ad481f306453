"""ringreduce.torch.DistributedOptimizer and friends, with ranks as threads (fast).

The central check is equivalence: N ranks with per-rank batch B/N end with the
same parameters as one process with batch B, for several optimizers and steps.

Misuse and the optimizer's life cycle are in test_torch_optimizer_misuse.py, broadcasts
and SyncBatchNorm in test_torch_broadcasts_and_syncbn.py; what they share is in
torch_opt_helpers.py.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch_opt_helpers import (  # noqa: E402
    OPTIMIZERS,
    data,
    make_net,
    make_opt,
    needs_engine,
    run,
    seeded,
    train,
    wrapped_net,
)

# autouse: every test runs with and without gradient buckets
from torch_opt_helpers import gradient_path as gradient_path  # noqa: E402

import ringreduce.torch as rrt  # noqa: E402


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


@pytest.mark.parametrize("passes", [1, 2])
def test_no_sync_accumulates_locally_then_averages_the_sum(passes):
    """DDP's no_sync: four quarter batches, the first ones inside no_sync() (no allreduce:
    nothing in flight after them), the rest completing backward_passes_per_step; the step
    equals one pass over the whole batch."""
    base, batches = make_net(), data(steps=3, batch=16)

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes)
        quiet = []
        for x, y in batches:
            opt.zero_grad()
            mine = slice(rank * 8, (rank + 1) * 8)
            for q in range(4):
                xs, ys = x[mine][2 * q:2 * q + 2], y[mine][2 * q:2 * q + 2]
                loss = torch.nn.functional.mse_loss(model(xs), ys) / 4
                if q < 4 - passes:
                    with opt.no_sync():
                        loss.backward()
                    quiet.append(not opt._rr_inflight)
                else:
                    loss.backward()
            opt.step()
        return model.state_dict(), all(quiet)

    out = run(2, fn)
    plain = copy.deepcopy(base)
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), batches, 0, 1)
    for k in want:
        torch.testing.assert_close(out[0][0][k], want[k], rtol=1e-9, atol=1e-12)
        assert torch.equal(out[0][0][k], out[1][0][k])
    assert out[0][1] and out[1][1], "an allreduce started inside no_sync()"


@pytest.mark.parametrize("passes", [1, 2])
def test_zero_grad_drops_gradients_only_accumulated_locally(passes):
    """A pass inside no_sync() (or short of backward_passes_per_step) then zero_grad(): the
    local gradients are dropped and the count starts again, as DDP and one process do."""
    base, batches = make_net(), data(steps=2, batch=8)

    def fn(rank):
        model = copy.deepcopy(base)
        opt = rrt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=passes)
        mine = slice(rank * 4, (rank + 1) * 4)
        (x0, y0), (x, y) = batches
        with opt.no_sync() if passes == 1 else contextlib.nullcontext():
            torch.nn.functional.mse_loss(model(x0[mine]), y0[mine]).backward()
        opt.zero_grad()  # discards that pass
        for _ in range(passes):
            (torch.nn.functional.mse_loss(model(x[mine]), y[mine]) / passes).backward()
        opt.step()
        return model.state_dict()

    out = run(2, fn)
    plain = copy.deepcopy(base)
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), batches[1:], 0, 1)
    for k in want:
        torch.testing.assert_close(out[0][k], want[k], rtol=1e-9, atol=1e-12)
        assert torch.equal(out[0][k], out[1][k])


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


def test_an_interrupted_stream_ordered_wait_keeps_the_gradient_until_the_device_is_done(
        monkeypatch):
    """CUDA gradients are waited for on the stream (optimizer._rr_finish -> wait_cuda_).
    A Ctrl-C inside that wait must leave the handle, which keeps the gradient alive for
    the device, to the optimizer's orphans, and make the next submit of the name wait for
    it; the same for a slot not reached yet. (Fakes stand in for the CUDA handles.)"""
    import ringreduce.torch.optimizer as optimizer_module

    class Pending:  # a HandleState whose device work is still running
        def done(self):
            return False

    class Handle:  # _core.ArrayHandle: keeps its gradient alive until dropped
        def __init__(self, t):
            self.obj, self.state = t, Pending()

        def done(self):
            return False

    def fn(rank):
        a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
        opt = rrt.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.1),
                                       named_parameters=[("a", a), ("b", b)])
        handles = []
        for s, p in zip(opt._rr_order, (a, b)):
            p.grad = torch.ones(4)
            handles.append(Handle(p.grad))
            s.handle, s.grad, s.buf, s.version, s.stream = \
                handles[-1], p.grad, p.grad, p.grad._version, 0
            opt._rr_inflight.append(s)

        def interrupted(handle, t, stream):
            raise KeyboardInterrupt  # as PyErr_CheckSignals in _core.gpu.wait_stream

        monkeypatch.setattr(optimizer_module, "wait_cuda_", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt.synchronize()
        assert opt._rr_orphans == handles  # both gradients stay alive
        assert [s.prior for s in opt._rr_order] == [h.state for h in handles]
        assert not opt._rr_inflight
        return True

    assert run(1, fn) == [True]
