"""Whole training step minus the forward pass, on ResNet-50's parameter list (torch).

Run under MPI (mpi4py bootstraps the peers and gathers timings)::

    mpirun -np 2 python benchmarks/torch_step.py
    mpirun -np 2 python benchmarks/torch_step.py --scale 0.2 --steps 10 --warmup 3

Every implementation owns a copy of ResNet-50's 161 parameters (``train_step.resnet50_shapes``,
25.6 M float32, ``--scale`` multiplies every count) and a retained autograd graph
``y_i = p_i * w_i`` built once; a step is what a training loop does after its forward pass:

* ``no-comm``: ``opt.zero_grad()``, ``torch.autograd.backward(ys, ones, retain_graph=True)``
  (autograd fills every ``p.grad`` in backward order, fc first), ``opt.step()`` (SGD, momentum
  0.9): the floor, no communication at all;
* ``ringreduce``: the same step through ``ringreduce.torch.DistributedOptimizer`` (defaults:
  gradient buckets on, hooks submitting during backward, averaging);
* ``rr-no-buckets``: the same with ``gradient_buckets=False`` (the path before buckets);
* ``mpi-loop``: the ``no-comm`` step with ``MPI_Allreduce(MPI_IN_PLACE, g)`` and a division
  by the world size for every gradient between backward and ``step()`` (off with
  ``--no-mpi-loop``).

What communication *adds* to a step is step time minus ``no-comm``'s. Before timing, one step
of each implementation from identical parameters, with rank-dependent integer weights (so
sums and averages are exact), must leave bitwise identical parameters. Steps are interleaved
(the order rotates every round), each preceded by a barrier; step time = max over ranks;
medians of ``--steps`` timed rounds after ``--warmup``. Issue 20's targets follow the table:
ringreduce adds at most a third of what ``mpi-loop`` adds, and at most half of what
``rr-no-buckets`` adds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Callable, Optional

import numpy as np
import torch
from bench_common import init_ringreduce
from mpi4py import MPI
from train_step import Summary, header_lines, resnet50_shapes, run_steps, verdict

import ringreduce.torch as hvd

COMM = MPI.COMM_WORLD
NOCOMM, RR, RR_NOBUCKETS, LOOP = "no-comm", "ringreduce", "rr-no-buckets", "mpi-loop"
#: Issue 20: what ringreduce adds, as a fraction of what the loop / the bucketless path add.
TARGET_VS_LOOP, TARGET_VS_NOBUCKETS = 1 / 3, 1 / 2


class Model:
    """One implementation's parameters, retained graph and optimizer."""

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]], weights: list,
                 impl: str) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(s)) for _, s in shapes]
        self.outputs = [p * w for p, w in zip(self.params, weights)]  # forward order
        self.ones = [torch.ones_like(y) for y in self.outputs]
        opt = torch.optim.SGD(self.params, lr=0.01, momentum=0.9)
        if impl in (RR, RR_NOBUCKETS):
            named = [(n, p) for (n, _), p in zip(shapes, self.params)]
            opt = hvd.DistributedOptimizer(opt, named_parameters=named,
                                           gradient_buckets=impl == RR)
        self.opt = opt
        self.impl = impl

    def backward(self) -> None:
        torch.autograd.backward(self.outputs, self.ones, retain_graph=True)

    def step(self) -> None:
        self.opt.zero_grad()
        self.backward()
        if self.impl == LOOP:
            n = COMM.Get_size()
            for p in reversed(self.params):  # backward order, as the gradients became ready
                COMM.Allreduce(MPI.IN_PLACE, p.grad.numpy())
                p.grad.div_(n)
        self.opt.step()


def scaled_shapes(scale: float) -> list[tuple[str, tuple[int, ...]]]:
    """ResNet-50's shapes with element counts scaled (flattened to 1-D; at least 1)."""
    return [(n, (max(1, round(int(np.prod(s)) * scale)),)) for n, s in resnet50_shapes()]


def build(impls: Sequence[str], scale: float) -> dict[str, Model]:
    """Every implementation's model; weights are 1 + rank (exact averages)."""
    shapes = scaled_shapes(scale)
    weights = [torch.full(s, 1.0 + COMM.Get_rank()) for _, s in shapes]
    return {impl: Model(shapes, weights, impl) for impl in impls}


def check(models: dict[str, Model]) -> dict[str, bool]:
    """One step of each from zeros; every communicating one must match ``mpi-loop`` (or,
    without it, ``ringreduce``) bitwise on every rank."""
    for m in models.values():
        m.step()
    ref = models.get(LOOP, models[RR])
    ok = {}
    for impl, m in models.items():
        if impl == NOCOMM:
            continue
        same = all(torch.equal(a, b) for a, b in zip(m.params, ref.params))
        ok[impl] = bool(COMM.allreduce(same, op=MPI.LAND))
    return ok


def table(results: Sequence[Summary], nbytes: int) -> list[str]:
    """Median and p90 step times, what communication adds, and ratios of the added times."""
    by = {s.impl: s for s in results}
    base = by[NOCOMM].median
    lines = [f"{'impl':<14} {'median ms':>10} {'p90 ms':>9} {'adds ms':>9} "
             f"{'adds/loop':>10} {'grad GB/s':>10}"]
    for s in results:
        adds = s.median - base
        loop = by[LOOP].median - base if LOOP in by else float("nan")
        lines.append(f"{s.impl:<14} {s.median * 1e3:>10.2f} {s.p90 * 1e3:>9.2f} "
                     f"{adds * 1e3:>9.2f} {adds / loop:>10.2f} "
                     f"{nbytes / s.median / 1e9:>10.2f}")
    lines.append(f"# adds = median step - {NOCOMM}'s median; grad GB/s = gradient bytes / "
                 "median step")
    return lines


def target_lines(results: Sequence[Summary]) -> list[str]:
    """Issue 20's two targets on what communication adds to a step."""
    by = {s.impl: s for s in results}
    base = by[NOCOMM].median
    mine = by[RR].median - base
    lines = []
    for other, limit in ((LOOP, TARGET_VS_LOOP), (RR_NOBUCKETS, TARGET_VS_NOBUCKETS)):
        if other in by:
            frac = mine / (by[other].median - base)
            lines.append(f"# target: {RR} adds <= {limit:.2f} of what {other} adds: "
                         f"{frac:.2f}  {verdict(frac <= limit)}")
    return lines


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiply every parameter count")
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (0: torch's default)")
    p.add_argument("--no-mpi-loop", action="store_true", help="leave the MPI loop out")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root, say = init_ringreduce(COMM)
    impls = [NOCOMM, RR, RR_NOBUCKETS] + ([] if args.no_mpi_loop else [LOOP])
    models = build(impls, args.scale)
    nbytes = sum(p.numel() * 4 for p in models[RR].params)
    for line in header_lines(args)[:-1]:  # its last line describes train_step's timing
        say(line)
    say(f"# {args.warmup} warm-up + {args.steps} timed steps per implementation, interleaved; "
        "step time = max over ranks")
    say(f"# {len(models[RR].params)} parameters, {nbytes / 1e6:.1f} MB of float32 gradients; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads per rank")
    ok = check(models)
    say("# check against " + (LOOP if LOOP in models else RR) + ": " +
        ", ".join(f"{k} {'ok' if v else 'WRONG'}" for k, v in ok.items()))
    steps: dict[str, Callable[[], None]] = {k: m.step for k, m in models.items()}
    results = run_steps(steps, args.warmup, args.steps)
    for line in table(results, nbytes) + target_lines(results):
        say(line)
    for impl, m in models.items():
        if impl in (RR, RR_NOBUCKETS):
            say(f"# {impl} buckets: {m.opt.bucket_stats()}")
    hvd.shutdown()
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
