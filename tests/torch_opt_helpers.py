"""What the DistributedOptimizer tests share (test_torch_optimizer.py,
test_torch_optimizer_misuse.py, test_torch_broadcasts_and_syncbn.py): the autouse fixture
that runs every test with and without gradient buckets, ranks as threads, a small seeded
net, its data, the optimizers under test and a plain reference training loop.

Import it after ``pytest.importorskip("torch")``; a test module takes the fixture with
``from torch_opt_helpers import gradient_path as gradient_path`` (the alias marks the
import as used: pytest finds the fixture among the module's names).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import ringreduce as rr
import ringreduce.torch as rrt
from ringreduce.testing import make_world, run_threaded

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


def _with(c, fn):
    with rrt.use_communicator(c):
        return fn(c.rank())
