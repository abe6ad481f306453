"""Blocking small calls of every kind: ringreduce against MPI (mpi4py) in the same run.

Metrics, losses, ``barrier()``, ``broadcast_object`` of a config and ``allgather_object``
of a status are the calls a training script makes between steps; each one blocks, so
what counts is the time of one call, not bandwidth. Every row times blocks of ``--iters``
back-to-back calls, alternating ringreduce's block and MPI's, and reports the median
over ``--reps`` blocks of the slowest rank's time per call (as a caller waits for the
last rank)::

    mpirun -np 2 python benchmarks/small_calls.py
    mpirun -np 2 python benchmarks/small_calls.py --bytes 4,1K --iters 2000 --reps 7

Results are checked against MPI's on every call of the last block.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import numpy as np
from bench_common import init_ringreduce
from mpi4py import MPI

import ringreduce as rr

Call = Callable[[], Any]


def parse_bytes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20}
    return [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in text.split(",")]


def time_block(comm: MPI.Comm, call: Call, iters: int) -> float:
    """Seconds per call of the slowest rank, over one block of ``iters`` calls."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def pairs(comm: MPI.Comm, nbytes: int) -> list[tuple[str, Call, Call]]:
    """(label, ringreduce's call, MPI's call), each returning what it computed."""
    r, n = comm.Get_rank(), comm.Get_size()
    x = np.full(max(1, nbytes // 4), r + 1, np.float32)
    buf = x.copy()
    gathered = np.empty(x.size * n, np.float32)
    obj = {"rank": r, "pad": "x" * max(0, nbytes - 30)}

    def mpi_allreduce() -> np.ndarray:
        out = np.empty_like(x)
        comm.Allreduce(x, out)
        return out

    def mpi_bcast() -> np.ndarray:
        buf[...] = x
        comm.Bcast(buf, 0)
        return buf.copy()

    def rr_bcast() -> np.ndarray:
        buf[...] = x
        return rr.broadcast_(buf, 0).copy()

    def mpi_allgather() -> np.ndarray:
        comm.Allgather(x, gathered)
        return gathered.copy()

    return [
        (f"allreduce {nbytes} B", lambda: rr.allreduce(x, op=rr.Sum), mpi_allreduce),
        (f"broadcast_ {nbytes} B", rr_bcast, mpi_bcast),
        (f"allgather {nbytes} B", lambda: rr.allgather(x), mpi_allgather),
        (f"broadcast_object ~{nbytes} B", lambda: rr.broadcast_object(obj, 0),
         lambda: comm.bcast(obj, 0)),
        (f"allgather_object ~{nbytes} B", lambda: rr.allgather_object(obj),
         lambda: comm.allgather(obj)),
    ]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return a == b


def measure(comm: MPI.Comm, label: str, ours: Call, theirs: Call, args: Any) -> tuple:
    for _ in range(args.warmup):
        ours(), theirs()
    rr_t, mpi_t = [], []
    for _ in range(args.reps):
        rr_t.append(time_block(comm, ours, args.iters))
        mpi_t.append(time_block(comm, theirs, args.iters))
    ok = comm.allreduce(int(same(ours(), theirs())), op=MPI.MIN) == 1
    return label, statistics.median(rr_t) * 1e6, statistics.median(mpi_t) * 1e6, ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bytes", default="4,1K", help="payload sizes, comma list (4,1K)")
    p.add_argument("--iters", type=int, default=1000, help="calls per timed block (1000)")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls first (50)")
    p.add_argument("--reps", type=int, default=5, help="timed blocks each; median (5)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    _, say = init_ringreduce(comm)
    say(f"# ranks {comm.Get_size()}, {args.reps} blocks of {args.iters} calls, median of the "
        "slowest rank's time per call")
    say(f"{'call':32s} {'ringreduce us':>14s} {'MPI us':>10s} {'rr/MPI':>7s}  check")
    rows = [("barrier", rr.barrier, comm.Barrier)]
    for nbytes in parse_bytes(args.bytes):
        rows += pairs(comm, nbytes)
    wrong = []
    for label, ours, theirs in rows:
        label, t_rr, t_mpi, ok = measure(comm, label, ours, theirs, args)
        wrong += [] if ok else [label]
        say(f"{label:32s} {t_rr:14.1f} {t_mpi:10.1f} {t_rr / t_mpi:6.1f}x  "
            f"{'ok' if ok else 'WRONG'}")
    say(f"# wrong results: {', '.join(wrong) if wrong else 'none'}")
    stats = rr._comm()._engine.stats()
    say(f"# rank 0 engine: {stats['responses']} responses, {stats['folded']} folded, "
        f"{stats['paired']} paired")


if __name__ == "__main__":
    main()
