"""Adasum benchmark: the engine's vector-halving exchange against the allgather path.

Run under MPI (mpi4py bootstraps the peers and gathers timings)::

    mpirun -np 2 python benchmarks/adasum.py
    mpirun -np 4 python benchmarks/adasum.py --max-bytes 16M --dtype float32

Columns per size (nccl-tests style): ``engine`` is ``rr.allreduce(x, op=rr.Adasum)`` on a
power-of-two job (csrc/collectives/allreduce_adasum.cc); ``gather`` is the same call forced
onto the allgather + float64 tree path that other rank counts take (by patching
``ringreduce._composite_calls.in_engine``); ``sum`` is a plain ``op=Sum`` allreduce for
scale. Each timed block is barrier, warm-up calls, barrier, ``iters`` calls; a rank takes
the median per-call time over ``--reps`` blocks, the table the maximum over ranks. The
implementations alternate within each size. algbw = bytes / time; busbw = algbw * 2(n-1)/n.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from bench_common import init_ringreduce
from mpi4py import MPI

import ringreduce as rr
from ringreduce import _composite_calls

COMM = MPI.COMM_WORLD
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"16M"`` -> 16777216."""
    text = text.strip().upper()
    unit = text[-1] if text[-1] in _UNITS else ""
    return int(float(text[:len(text) - len(unit)]) * _UNITS[unit])


def human(nbytes: float) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:g}{unit}"
    return f"{nbytes:g}"


def call(name: str, x: np.ndarray) -> Callable[[], None]:
    """One timed call of implementation ``name`` on ``x`` (a new result each call)."""
    if name == "sum":
        return lambda: rr.allreduce(x, op=rr.Sum, name="bench.sum")
    engine = name == "engine"

    def run() -> None:
        saved = _composite_calls.in_engine
        _composite_calls.in_engine = (lambda size: saved(size)) if engine else (lambda size: False)
        try:
            rr.allreduce(x, op=rr.Adasum, name=f"bench.{name}")
        finally:
            _composite_calls.in_engine = saved
    return run


def time_block(fn: Callable[[], None], iters: int, warmup: int) -> float:
    COMM.Barrier()
    for _ in range(warmup):
        fn()
    COMM.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    root, say = init_ringreduce(COMM)
    n = rr.size()
    if n & (n - 1):
        raise SystemExit(f"the engine path needs a power-of-two job; got {n} ranks")
    dtype = np.dtype(args.dtype)
    impls = ("engine", "gather", "sum")
    say(f"# Adasum, {n} ranks, {dtype}, busbw = algbw * 2(n-1)/n; time in us, bw in GB/s")
    say(f"{'size':>8} {'count':>10}" + "".join(
        f" {i + ' time':>12} {'algbw':>7} {'busbw':>7}" for i in impls) + f" {'gather/engine':>14}")
    size = parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        count = size // dtype.itemsize
        x = np.random.default_rng(rr.rank()).standard_normal(count).astype(dtype)
        iters = max(3, min(200, (64 << 20) // max(size, 1) // 4))
        times: dict[str, list[float]] = {i: [] for i in impls}
        for rep in range(args.reps):
            order = impls[rep % 3:] + impls[:rep % 3]
            for impl in order:
                times[impl].append(time_block(call(impl, x), iters, max(1, iters // 10)))
        worst = {i: COMM.allreduce(statistics.median(times[i]), op=MPI.MAX) for i in impls}
        row = f"{human(size):>8} {count:>10}"
        for i in impls:
            algbw = size / worst[i] / 1e9
            row += f" {worst[i] * 1e6:>12.1f} {algbw:>7.2f} {algbw * 2 * (n - 1) / n:>7.2f}"
        say(row + f" {worst['gather'] / worst['engine']:>14.2f}")
        size *= 4
    rr.shutdown()


if __name__ == "__main__":
    main()
