"""ringreduce.torch's broadcasts and SyncBatchNorm, with ranks as threads:
broadcast_parameters (state dicts, named parameters, lists) and broadcast_optimizer_state
bring every rank to the root's values or report a mismatch everywhere; SyncBatchNorm over
the ranks matches BatchNorm over the whole batch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_opt_helpers import _with, make_net, make_opt, run, seeded  # noqa: E402

# autouse: every test runs with and without gradient buckets
from torch_opt_helpers import gradient_path as gradient_path  # noqa: E402

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402


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
