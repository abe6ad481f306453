"""What every MPI-launched benchmark here starts with."""

from __future__ import annotations

from typing import Callable

from mpi4py import MPI

import ringreduce as rr


def init_ringreduce(comm: MPI.Comm) -> tuple[bool, Callable[..., None]]:
    """Initialize ringreduce and check that it sees the same world as MPI.

    Returns
    -------
    root : bool
        True on rank 0.
    say : callable
        ``print`` on rank 0, a no-op elsewhere.
    """
    rr.init()
    if rr.size() != comm.Get_size():
        raise RuntimeError(f"ringreduce size {rr.size()} != MPI size {comm.Get_size()}")
    root = comm.Get_rank() == 0
    return root, (print if root else (lambda *a, **k: None))
