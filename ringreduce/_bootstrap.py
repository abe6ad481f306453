"""Rank discovery and endpoint exchange.

Five launch modes, tried in this order:

0. under an elastic driver (``ringrun --min-np/--max-np``): the driver assigns rank and
   size for each generation and relays the endpoint records (``elastic/_client.py``).
1. under an MPI launcher (Open MPI, MPICH/Hydra, Intel MPI, SLURM srun with
   PMI): mpi4py gives rank and size, broadcasts the job secret and allgathers
   the endpoint records. MPI carries only these few bytes, never data.
2. torchrun-style environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
   ``MASTER_PORT``. Rank 0 serves a TCP store on MASTER_PORT; the secret comes
   from ``RINGREDUCE_SECRET`` or, failing that, from rank 0 through the store.
3. TensorFlow's ``TF_CONFIG`` (set by Kubeflow's TFJob, Vertex AI, and by hand for
   ``MultiWorkerMirroredStrategy``): the same, with the ranks read off the cluster spec
   (``tf_config_launch``).
4. otherwise a single process (size 1).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Callable

from . import _core
from .exceptions import InvalidInputError, PeerLostError, RingReduceError, RingReduceTimeoutError

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


def _env_int(name: str, env: Mapping[str, str] = os.environ) -> int:
    try:
        return int(env[name])
    except ValueError as err:
        raise InvalidInputError(f"environment variable {name}={env[name]!r} "
                                "is not an integer") from err


def tf_config_launch(text: str) -> dict[str, str]:
    """The env-var launch (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) that
    a ``TF_CONFIG`` describes: the chief (if any) is rank 0, then the workers in order;
    rank 0's address is the rendezvous (its port is free: no ``tf.train.Server`` runs).
    Parameter servers and evaluators have no place in an allreduce job and are refused."""
    try:
        config = json.loads(text)
        cluster, task = config["cluster"], config["task"]
        kind, index = str(task["type"]), int(task.get("index", 0))
        ranks = [("chief", i, a) for i, a in enumerate(cluster.get("chief", []))] \
            + [("worker", i, a) for i, a in enumerate(cluster.get("worker", []))]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InvalidInputError(f"TF_CONFIG is not a cluster spec with a task: {err!r} "
                                f"in {text[:200]!r}") from err
    if kind not in ("chief", "worker"):
        raise InvalidInputError(
            f"TF_CONFIG: task {kind}:{index} has no place in a ringreduce job (ranks are "
            "the chief and the workers, which average gradients among themselves); drop "
            f"the {kind} replicas from the job")
    mine = [r for r, (k, i, _) in enumerate(ranks) if (k, i) == (kind, index)]
    if not mine:
        raise InvalidInputError(f"TF_CONFIG: task {kind}:{index} is not in the cluster spec "
                                f"({len(ranks)} chief/worker task(s))")
    host, _, port = ranks[0][2].rpartition(":")
    if not host or not port.isdigit():
        raise InvalidInputError(f"TF_CONFIG: {ranks[0][0]}:0's address {ranks[0][2]!r} is "
                                "not host:port")
    return {"RANK": str(mine[0]), "WORLD_SIZE": str(len(ranks)),
            "MASTER_ADDR": host.strip("[]"), "MASTER_PORT": port}


def _mpi() -> tuple[int, int, bytes, Exchange]:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise InvalidInputError(
            "this process was started by an MPI launcher but mpi4py is not installed; "
            "install it with: pip install 'ringreduce[mpi]'"
        ) from err
    comm = MPI.COMM_WORLD
    check_slurm_world(comm.Get_size())
    secret = comm.bcast(os.urandom(32) if comm.Get_rank() == 0 else None, root=0)

    def exchange(mine: bytes) -> list[bytes]:
        infos = comm.allgather(mine)
        # Every rank has left MPI_Init (it took part in the allgather), so every
        # local rank has mapped MPICH's segments by now.
        unlink_mpich_segments()
        return infos

    return comm.Get_rank(), comm.Get_size(), secret, exchange


def check_slurm_world(mpi_size: int) -> None:
    """Refuse a job that srun started as several tasks but MPI sees as one process each.

    ``srun`` without a PMI plugin MPI understands (``--mpi=pmi2`` for MPICH, ``pmix`` for
    Open MPI, unless the cluster's ``MpiDefault`` is one) starts every task as an MPI
    singleton: each would train alone, silently, as rank 0 of 1.
    """
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    if mpi_size != 1 or "SLURM_PROCID" not in os.environ or not tasks or not tasks.isdigit() \
            or int(tasks) <= 1:
        return
    raise InvalidInputError(
        f"srun started {tasks} tasks (this is task {os.environ['SLURM_PROCID']}), but MPI "
        "sees a world of 1: srun gave MPI no process manager interface it understands. "
        "Run srun with --mpi=pmi2 (MPICH, Intel MPI) or --mpi=pmix (Open MPI), or set "
        "MpiDefault in slurm.conf; `srun --mpi=list` shows what the cluster has")


def unlink_mpich_segments(maps: str = "/proc/self/maps") -> list[str]:
    """Unlink the /dev/shm segments MPICH's MPI_Init made that this process maps.

    MPICH (ch4) keeps a segment of 1-2 MB per host named until MPI_Finalize, so a rank
    killed under mpirun leaves it in /dev/shm for good. Once every local rank has mapped
    it, the name serves nothing (the mappings stay valid and MPICH's own unlink at
    finalize tolerates its absence), as ringreduce's own segments are unlinked once
    mapped. Returns the paths unlinked.

    Parameters
    ----------
    maps : str
        The memory map to read (this process's).
    """
    done = []
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
    except OSError:
        return done
    for path in sorted(paths):
        if not path.startswith("/dev/shm/mpich_shm_"):
            continue  # already unlinked ("... (deleted)")
        try:
            os.unlink(path)
            done.append(path)
        except OSError:
            pass  # another local rank was first
    return done


def _env_store(env: Mapping[str, str] = os.environ) -> tuple[int, int, bytes, Exchange]:
    rank, size = _env_int("RANK", env), _env_int("WORLD_SIZE", env)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT", env) if "MASTER_PORT" in env else 29500
    timeout = float(os.environ.get("RINGREDUCE_CONNECT_TIMEOUT_SECONDS", "60"))
    secret_env = os.environ.get("RINGREDUCE_SECRET", "")
    secret = secret_env.encode() if secret_env else os.urandom(32)
    job = _job_identity(size, secret if secret_env else None)
    server = _serve_store(port, addr, timeout, job) if rank == 0 else None
    deadline = time.monotonic() + timeout
    while True:
        store = _core.TcpStoreClient(addr, port, timeout)
        try:
            if _claim(store, rank, job, f"{addr}:{port}", timeout):
                break
        except PeerLostError:
            # The store closed under us: a previous rendezvous's rank 0 shutting down
            # while this process re-inits. Retry until the new one is up (or time is out).
            if rank == 0 or time.monotonic() > deadline:
                raise
        # This process's previous init() (before a shutdown()) still owns the rank
        # in a rendezvous whose rank 0 has not shut down yet: wait for the new one.
        del store
        if time.monotonic() > deadline:
            raise InvalidInputError(f"rank {rank}: the rendezvous at {addr}:{port} is still "
                                    "the one of this process's previous init() after "
                                    f"{timeout} s; {_CONFLICT_HINT}")
        time.sleep(0.1)
    if rank == 0 and not secret_env:
        store.set("rr/secret", secret)
    elif not secret_env:
        secret = store.get("rr/secret", timeout)

    def exchange(mine: bytes) -> list[bytes]:
        infos = store.allgather("rr/endpoints", rank, size, mine, timeout)
        # Rank 0 keeps the store up until every other rank says it has read
        # everything; only rank 0 reads these keys, so closing after is safe.
        # A worker checks for a conflict before it says so (then the store may
        # close); rank 0 after every worker did, and fails the job if one arose.
        if rank != 0:
            _check_conflict(store, rank, f"{addr}:{port}")
            store.set(f"rr/done/{rank}", b"")
        else:
            _await_workers(store, size, f"{addr}:{port}", timeout)
        return infos

    # Rank 0's server stays up for the job's lifetime (closed by shutdown()):
    # the port stays taken, and ranks of a later job that reach it are refused.
    exchange.rendezvous = server  # type: ignore[attr-defined]
    return rank, size, secret, exchange


# Two jobs started at once on one MASTER_ADDR:MASTER_PORT must refuse each other,
# not merge. The store is rank 0's, so every claim goes through one place:
#   rank 0 publishes the job's identity under "rr/job" (world size, and a digest
#   of RINGREDUCE_SECRET when the launcher gave one, as ringrun does); every
#   other rank compares it with its own before writing anything, so a rank of
#   another job with another secret or size is refused and the job is untouched;
#   each rank claims "rr/rank/<r>" atomically (Store.add); a second process
#   claiming a taken rank is refused, and so is a would-be rank 0 that finds the
#   port taken; both mark the rendezvous "rr/conflict", and every rank checks
#   that mark once the exchange is complete, so the job they stumbled into
#   fails with the same explanation instead of running with a stranger.
# Without a secret two jobs of equal size look alike until they collide on a
# rank; with one (ringrun makes one per job) the refusal is exact.
_CONFLICT_HINT = ("two jobs on one MASTER_ADDR:MASTER_PORT? Give each job its own MASTER_PORT "
                  "(ringrun picks a free one) or its own RINGREDUCE_SECRET")


def _process() -> str:
    return f"host {socket.gethostname()} pid {os.getpid()}"


def _identity() -> str:
    """This process's claim in one rendezvous: the process, and this init() of it."""
    return f"{_process()} ({os.urandom(6).hex()})"


def _job_identity(size: int, secret: bytes | None) -> str:
    import hashlib

    return f"size {size} secret " + (hashlib.sha256(secret).hexdigest()[:16] if secret else "-")


def _serve_store(port: int, addr: str, timeout: float, job: str) -> object:
    try:
        return _core.TcpStoreServer("0.0.0.0", port)
    except RingReduceError as err:
        why = (f"rank 0 of another job ({_identity()}) found MASTER_PORT {port} taken: {err}")
        try:  # warn the job that holds the port if it cannot tell us from itself
            other = _core.TcpStoreClient(addr, port, min(timeout, 2.0))
            if other.get("rr/job", min(timeout, 2.0)).decode() == job:
                other.set("rr/conflict", why.encode())
        except RingReduceError:
            pass
        raise InvalidInputError(f"rank 0: cannot serve the rendezvous on port {port}: {err}; "
                                f"{_CONFLICT_HINT}") from err


def _claim(store: object, rank: int, job: str, where: str, timeout: float) -> bool:
    """Check the job and claim ``rank``; False if the store is this process's previous
    rendezvous (re-init after shutdown while the old rank 0 still serves it)."""
    if rank == 0:
        store.set("rr/job", job.encode())
    else:
        theirs = store.get("rr/job", timeout).decode()
        if theirs != job:
            raise InvalidInputError(f"rank {rank}: the rendezvous at {where} belongs to another "
                                    f"job (it has {theirs}, this rank {job}); {_CONFLICT_HINT}")
    me = _identity()
    owner = store.add(f"rr/rank/{rank}", me.encode()).decode()
    if owner != me and owner.startswith(_process() + " ("):
        return False
    if owner != me:
        why = f"rank {rank} was claimed twice: by {owner} and by {me}"
        store.set("rr/conflict", why.encode())
        raise InvalidInputError(f"rank {rank}: the rendezvous at {where} already has a rank "
                                f"{rank} ({owner}); {_CONFLICT_HINT}")
    return True


def _await_workers(store: object, size: int, where: str, timeout: float) -> None:
    """Rank 0: wait until every worker read the endpoints, failing at once on a conflict."""
    deadline = time.monotonic() + timeout
    for r in range(1, size):
        while True:
            try:
                store.get(f"rr/done/{r}", min(0.5, max(deadline - time.monotonic(), 0)))
                break
            except RingReduceTimeoutError:
                _check_conflict(store, 0, where)
                if time.monotonic() >= deadline:
                    raise
    _check_conflict(store, 0, where)


def _check_conflict(store: object, rank: int, where: str) -> None:
    mark = store.add("rr/conflict", b"").decode()
    if mark:
        raise InvalidInputError(f"rank {rank}: the rendezvous at {where} was joined by another "
                                f"job ({mark}); {_CONFLICT_HINT}")


def discover() -> tuple[int, int, bytes, Exchange]:
    """Return (rank, size, job secret, exchange function) for this launch.

    Under the env-var launch rank 0's exchange function carries the rendezvous
    server as its ``rendezvous`` attribute (see ``connect``).
    """
    from .elastic import _client as elastic

    if elastic.in_elastic_job():
        return elastic.discover()
    if launched_by_mpi():
        return _mpi()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _env_store()
    if os.environ.get("TF_CONFIG"):
        return _env_store({**os.environ, **tf_config_launch(os.environ["TF_CONFIG"])})
    return 0, 1, os.urandom(32), lambda mine: [mine]


def connect() -> tuple[_core.Context, object]:
    """Create and connect this process's core Context; also return what must live as long
    (rank 0's rendezvous server under the env-var launch, else None).

    In an elastic job a generation that breaks up while it connects (a member died) is
    joined again, as often as the driver forms a new one; it ends the job otherwise.
    """
    from .elastic import _client as elastic

    while True:
        try:
            return _connect_once()
        except PeerLostError as err:
            if not elastic.in_elastic_job():
                raise
            print(f"ringreduce: elastic worker {elastic.worker_id()}: rejoining ({err})",
                  file=sys.stderr, flush=True)
            elastic.Membership.wants_sync = True


def _connect_once() -> tuple[_core.Context, object]:
    rank, size, secret, exchange = discover()
    server = getattr(exchange, "rendezvous", None)
    ctx = _core.Context(rank, size, secret, host_id())
    try:
        ctx.connect(list(exchange(ctx.local_info())))
    except BaseException:
        if server is not None:
            server.close()
        raise
    return ctx, server
