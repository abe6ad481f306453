"""Idle cost of the engine: CPU time per rank while ringreduce is initialized and unused.

Run under MPI; ``--hosts K`` splits the ranks into K fake hosts (``RINGREDUCE_HOST_ID``), so
ranks on one host talk over shm and across hosts over TCP, as in a multi-host job::

    mpirun -np 3 python benchmarks/idle_cpu.py --hosts 2

Rank 0 is the engine's coordinator; in a multi-host job it waits on shm and TCP peers at
once (coordination/doorbell_watcher.h). Each rank prints its links and the process CPU time
(all threads) over ``--seconds`` of sleep, as a percentage of one core.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Optional

import numpy as np
from bench_common import init_ringreduce
from mpi4py import MPI
from train_step import idle_cpu_percent

import ringreduce as rr


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags (``argv`` without the program name; None: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=1, help="fake hosts to split the ranks into (1)")
    p.add_argument("--seconds", type=float, default=3.0, help="idle period (3)")
    args = p.parse_args(argv)
    if args.hosts < 1 or args.seconds <= 0:
        p.error("need --hosts >= 1 and --seconds > 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Initialize, run one collective, sleep, print every rank's idle CPU on rank 0."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    if args.hosts > 1:
        os.environ["RINGREDUCE_HOST_ID"] = f"fake-host-{r * args.hosts // n}"
    root, say = init_ringreduce(comm)
    rr.allreduce(np.ones(4))  # the engine has started and run a round
    links = ", ".join(f"{p}:{rr._comm().transport_to(p)}" for p in range(n) if p != r)
    idle = idle_cpu_percent(args.seconds)
    lines = comm.gather(f"rank {r} (links {links or 'none'}): idle CPU {idle[r][0]:.2f}% of "
                        f"one core, {idle[r][1]} threads")
    if root:
        say(f"# {n} ranks on {args.hosts} fake host(s), {args.seconds:g} s asleep")
        say("\n".join(lines))
    rr.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
