"""One large allreduce, over and over: the time of every ring in order, to see patterns.

Run under MPI::

    mpirun -np 2 python benchmarks/ring_series.py
    mpirun -np 2 python benchmarks/ring_series.py --mib 97.5 --rings 96 --period 8

Each ring is an in-place Sum ``allreduce_`` of one float32 array (default 97.5 MiB, a
ResNet-50 gradient), preceded by a pass over another array of the same size (so the reduced
one comes from memory, as in a training step) and a barrier; its time is the maximum over
ranks; two untimed rings go first. Printed: every ring's time in ms, in order, then the
median of the rings at each position modulo ``--period``. A choice the engine revisits every
k rings (such as the shm transport's streaming-store exploration,
``transport/stream_choice.h``) shows as one slow position when ``--period`` is k.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Optional

import numpy as np
from bench_common import init_ringreduce
from mpi4py import MPI

import ringreduce as rr

COMM = MPI.COMM_WORLD


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags (``argv`` without the program name; None: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=97.5, help="array size in MiB (97.5)")
    p.add_argument("--rings", type=int, default=96, help="rings to time (96)")
    p.add_argument("--period", type=int, default=8, help="group ring times modulo this (8)")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.rings < 1 or args.period < 1:
        p.error("need --mib > 0, --rings >= 1, --period >= 1")
    return args


def series(n: int, rings: int) -> np.ndarray:
    """Per-ring time in seconds (max over ranks) of ``rings`` allreduces of ``n`` floats."""
    flat = np.zeros(n, np.float32)
    other = np.zeros(n, np.float32)
    for _ in range(2):  # the first rings set up buffers and pick the transport's first choices
        rr.allreduce_(flat, op=rr.Sum, name="ring_series")
    local = np.empty(rings)
    for k in range(rings):
        other += 1  # evicts `flat` from the caches
        COMM.Barrier()
        t0 = time.perf_counter()
        rr.allreduce_(flat, op=rr.Sum, name="ring_series")
        local[k] = time.perf_counter() - t0
    worst = np.empty_like(local)
    COMM.Allreduce(local, worst, op=MPI.MAX)
    return worst


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Time the rings and print them (rank 0). Returns the exit status (0)."""
    args = parse_args(argv)
    _, say = init_ringreduce(COMM)
    n = int(args.mib * (1 << 20)) // 4
    say(f"# {rr.size()} ranks, {n * 4 / (1 << 20):.1f} MiB float32 Sum, in place; "
        f"{args.rings} rings; ms, max over ranks")
    ms = series(n, args.rings) * 1e3
    say(" ".join(f"{x:.1f}" for x in ms))
    say(f"# median by ring index mod {args.period}: " + " | ".join(
        f"{j}: {np.median(ms[j::args.period]):.1f}" for j in range(min(args.period, len(ms)))))
    say(f"# all: median {np.median(ms):.1f}, mean {ms.mean():.1f}, p90 "
        f"{np.percentile(ms, 90):.1f}")
    COMM.Barrier()
    rr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
