"""Rank discovery and endpoint exchange.

Three launch modes, tried in this order:

1. under an MPI launcher (Open MPI, MPICH/Hydra, Intel MPI, SLURM srun with
   PMI): mpi4py gives rank and size, broadcasts the job secret and allgathers
   the endpoint records. MPI carries only these few bytes, never data.
2. torchrun-style environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
   ``MASTER_PORT``. Rank 0 serves a TCP store on MASTER_PORT; the secret comes
   from ``RINGREDUCE_SECRET`` or, failing that, from rank 0 through the store.
3. otherwise a single process (size 1).
"""

from __future__ import annotations

import os
import socket
from typing import Callable

from . import _core
from .exceptions import InvalidInputError

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
            "HYDI_CONTROL_FD", "I_MPI_HYDRA_TOPOLIB", "MV2_COMM_WORLD_SIZE")
Exchange = Callable[[bytes], list[bytes]]


def host_id() -> str:
    """Identity of this host: ranks with equal ids talk through shared memory.

    ``RINGREDUCE_HOST_ID``, or the hostname and boot id; either way followed by the PID
    namespace, because shared-memory links tell that a local peer died from its pid, which
    means nothing in another PID namespace (containers of one pod share hostname and boot
    id): ranks in different namespaces count as different hosts and talk over TCP.
    """
    base = os.environ.get("RINGREDUCE_HOST_ID")
    if not base:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        base = f"{socket.gethostname()}/{boot}"
    try:
        namespace = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return base
    return f"{base}/{namespace}"


def launched_by_mpi() -> bool:
    """True when an MPI launcher (or srun) started this process."""
    if any(k in os.environ for k in _MPI_ENV):
        return True
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ \
        and "RANK" not in os.environ


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError as err:
        raise InvalidInputError(f"environment variable {name}={os.environ[name]!r} "
                                "is not an integer") from err


def _mpi() -> tuple[int, int, bytes, Exchange]:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise InvalidInputError(
            "this process was started by an MPI launcher but mpi4py is not installed; "
            "install it with: pip install 'ringreduce[mpi]'"
        ) from err
    comm = MPI.COMM_WORLD
    secret = comm.bcast(os.urandom(32) if comm.Get_rank() == 0 else None, root=0)
    return comm.Get_rank(), comm.Get_size(), secret, comm.allgather


def _env_store() -> tuple[int, int, bytes, Exchange]:
    rank, size = _env_int("RANK"), _env_int("WORLD_SIZE")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT") if "MASTER_PORT" in os.environ else 29500
    timeout = float(os.environ.get("RINGREDUCE_CONNECT_TIMEOUT_SECONDS", "60"))
    server = _core.TcpStoreServer("0.0.0.0", port) if rank == 0 else None
    store = _core.TcpStoreClient(addr, port, timeout)
    secret_env = os.environ.get("RINGREDUCE_SECRET", "")
    if secret_env:
        secret = secret_env.encode()
    elif rank == 0:
        secret = os.urandom(32)
        store.set("rr/secret", secret)
    else:
        secret = store.get("rr/secret", timeout)

    def exchange(mine: bytes) -> list[bytes]:
        infos = store.allgather("rr/endpoints", rank, size, mine, timeout)
        # Rank 0 keeps the store up until every other rank says it has read
        # everything; only rank 0 reads these keys, so closing after is safe.
        if rank != 0:
            store.set(f"rr/done/{rank}", b"")
        else:
            for r in range(1, size):
                store.get(f"rr/done/{r}", timeout)
            server.close()
        return infos

    return rank, size, secret, exchange


def discover() -> tuple[int, int, bytes, Exchange]:
    """Return (rank, size, job secret, exchange function) for this launch."""
    if launched_by_mpi():
        return _mpi()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _env_store()
    return 0, 1, os.urandom(32), lambda mine: [mine]


def connect() -> _core.Context:
    """Create and connect this process's core Context."""
    rank, size, secret, exchange = discover()
    ctx = _core.Context(rank, size, secret, host_id())
    ctx.connect(list(exchange(ctx.local_info())))
    return ctx
