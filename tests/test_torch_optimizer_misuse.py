"""ringreduce.torch.DistributedOptimizer used wrongly, and its life cycle, with ranks as
threads: misuse is reported on every rank (never a hang or a silent wrong average), an
interrupted step leaves the optimizer usable, a newer optimizer takes over the parameters,
and a dropped one holds nothing alive.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from torch_opt_helpers import _with, make_net, run, seeded, wrapped_net  # noqa: E402

# autouse: every test runs with and without gradient buckets
from torch_opt_helpers import gradient_path as gradient_path  # noqa: E402

import ringreduce as rr  # noqa: E402
import ringreduce.torch as rrt  # noqa: E402
from ringreduce.testing import run_threaded  # noqa: E402


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
