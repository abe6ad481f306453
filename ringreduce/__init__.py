"""ringreduce: data-parallel training with a C++ ring allreduce.

Horovod-compatible API on numpy arrays (and anything with DLPack or the
buffer protocol)::

    import numpy as np
    import ringreduce as rr

    rr.init()
    g = rr.allreduce(np.ones(1000, np.float32), op=rr.Average, name="grad")
    rr.shutdown()
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import numpy as np

from . import _horovod_settings, elastic  # elastic: hvd.elastic
from ._adasum import Adasum
from ._call_checks import Average, Max, Min, Product, Sum
from ._communicator import Communicator, Handle, reduce_isa
from ._cuda_arrays import register_gpu_array_type as register_gpu_array_type
from ._gpu import cuda_built, nccl_built
from ._gpu import gpu_info as gpu_info  # in __all__ once ringreduce.torch re-exports it
from ._gpu import nccl_version as nccl_version  # likewise
from .exceptions import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidInputError,
    MismatchError,
    NotInitializedError,
    PeerLostError,
    RingReduceError,
    RingReduceTimeoutError,
)
from .process_sets import ProcessSet, global_process_set

__version__ = "0.1.0"

__all__ = [
    "Adasum", "Average", "Communicator", "Handle", "HorovodInternalError", "HostsUpdatedInterrupt",
    "InvalidInputError", "Max", "Min", "MismatchError",
    "NotInitializedError", "PeerLostError", "Product", "RingReduceError",
    "RingReduceTimeoutError", "Sum", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "cross_rank", "cross_size", "elastic",
    "grouped_allreduce",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "init",
    "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "poll", "rank", "reduce_isa",
    "reducescatter", "reducescatter_async", "shared_zeros", "shutdown", "size",
    "start_timeline", "stop_timeline", "synchronize",
    "use_communicator", "cuda_built", "nccl_built", "run", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set",
]


class _Process:
    """Holds the process's default Communicator between init() and shutdown()."""

    comm: Optional[Communicator] = None
    process_sets: Union[None, str, Sequence[ProcessSet]] = None  # of the last init()


def init(process_sets: Union[None, str, Sequence[ProcessSet]] = None) -> None:
    """Join the job: discover rank and size, connect to the peers.

    Under mpirun (Open MPI, MPICH, Intel MPI, srun) the launcher's ranks are
    used; otherwise ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
    (torchrun-style); otherwise a single process. Calling it twice is harmless.

    Parameters
    ----------
    process_sets : list of ProcessSet or "dynamic", optional
        Static process sets to register (the same on every rank), or "dynamic" to allow
        ``add_process_set`` / ``remove_process_set`` (as Horovod's ``hvd.init``).
    """
    if _Process.comm is None:
        from ._bootstrap import connect

        _horovod_settings.apply_to_environ()
        _Process.process_sets = process_sets
        if process_sets not in (None, "dynamic") and elastic.in_elastic_job():
            raise InvalidInputError(
                "init(process_sets=[...]): static process sets cannot follow an elastic "
                "job, whose ranks change at every reset; use init(process_sets=\"dynamic\") "
                "and add_process_set() after each reset (a reset callback)")
        comm = Communicator(*connect())
        try:
            comm.process_sets.setup(process_sets)
        except BaseException:
            comm.close()
            raise
        _Process.comm = comm
        _horovod_settings.warn_no_effect(os.environ, comm.rank())
        # Registered after mpi4py's own exit hook (imported by connect), so it
        # runs first: peers learn this rank left before MPI_Finalize can block.
        atexit.unregister(shutdown)
        atexit.register(shutdown)


def _reinit() -> None:
    """``init()`` with the last call's arguments (an elastic reset)."""
    init(_Process.process_sets)


def shutdown() -> None:
    """Leave the job and release links and shared memory. Harmless if not initialized."""
    comm, _Process.comm = _Process.comm, None
    if comm is not None:
        comm.close()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _Process.comm is not None


class _ThreadState(threading.local):
    """Per-thread state; the class default spares every call a missed-attribute lookup
    (``getattr(local, name, None)`` on an unset name costs ~0.6 µs, on the submit path)."""

    comm: Optional[Communicator] = None


_thread = _ThreadState()


@contextmanager
def use_communicator(comm: Communicator) -> Iterator[Communicator]:
    """Route this thread's module-level calls to ``comm`` (threads-as-ranks testing).

    Parameters
    ----------
    comm : Communicator
        E.g. one of ``ringreduce.testing.make_world(n)``.
    """
    old = _thread.comm
    _thread.comm = comm
    try:
        yield comm
    finally:
        _thread.comm = old


def _override() -> Optional[Communicator]:
    return _thread.comm


def _binder(process_set: Optional[ProcessSet] = None,
            what: str = "ringreduce") -> Callable[[], Communicator]:
    """A function returning the communicator that is current now (its view of
    ``process_set``, if given: InvalidInputError naming ``what`` if this rank is not a
    member).

    Long-lived objects of the framework layers (optimizers, autograd contexts,
    traced graphs) keep it so that their later collectives (from hooks, backward,
    graph execution on another thread) reach the same communicator; without an
    override it follows ``init()``/``shutdown()`` of the process default.
    """
    override = _thread.comm
    bound = _comm if override is None else (lambda: override)
    if process_set is None or process_set.process_set_id == 0:
        return bound
    return lambda: bound().process_sets.communicator(process_set, what)


def _on(process_set: Optional[ProcessSet], what: str) -> Communicator:
    """The communicator of ``process_set`` on this rank (the current one for the global set);
    InvalidInputError if this rank is not a member."""
    c = _comm()
    if process_set is global_process_set or process_set is None or \
            process_set.process_set_id == 0:
        return c
    return c.process_sets.communicator(process_set, what)


def _comm() -> Communicator:
    override = _thread.comm
    if override is not None:
        return override
    if _Process.comm is None:
        raise NotInitializedError(
            "ringreduce has not been initialized: call ringreduce.init() first "
            "(after shutdown(), call init() again)")
    return _Process.comm


def rank() -> int:
    """This process's rank in [0, size())."""
    return _comm().rank()


def size() -> int:
    """Number of processes in the job."""
    return _comm().size()


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _comm().local_rank()


def local_size() -> int:
    """Number of processes on this host."""
    return _comm().local_size()


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return _comm().cross_rank()


def cross_size() -> int:
    """Number of hosts in the job."""
    return _comm().cross_size()


def is_homogeneous() -> bool:
    """Whether every host of the job runs as many ranks as the others (Horovod's)."""
    return _comm().is_homogeneous()


def allreduce(x: Any, op: int = Average, name: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, *,
              compression: Optional[str] = None) -> np.ndarray:
    """Reduce ``x`` across ranks; new array. See ``Communicator.allreduce``."""
    c = _on(process_set, "allreduce")
    return c.allreduce(x, op, name, prescale_factor, postscale_factor,
                       compression=compression)


def allreduce_(x: Any, op: int = Average, name: Optional[str] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, *,
               compression: Optional[str] = None) -> Any:
    """Reduce ``x`` across ranks in place and return it."""
    c = _on(process_set, "allreduce_")
    return c.allreduce_(x, op, name, prescale_factor, postscale_factor,
                        compression=compression)


def allgather(x: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's ``x`` along axis 0 (lengths may differ)."""
    c = _on(process_set, "allgather")
    return c.allgather(x, name)


def broadcast(x: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return root_rank's ``x`` on every rank, as a new array."""
    c = _on(process_set, "broadcast")
    return c.broadcast(x, root_rank, name)


def broadcast_(x: Any, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Overwrite ``x`` with root_rank's ``x`` in place and return it."""
    c = _on(process_set, "broadcast_")
    return c.broadcast_(x, root_rank, name)


def reducescatter(x: Any, op: int = Average, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``x`` across ranks and return this rank's share of axis 0."""
    c = _on(process_set, "reducescatter")
    return c.reducescatter(x, op, name, prescale_factor, postscale_factor)


def alltoall(x: Any, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Exchange rows of ``x`` between all ranks. See ``Communicator.alltoall``."""
    c = _on(process_set, "alltoall")
    return c.alltoall(x, splits, name)


def shared_zeros(shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """A zero-filled array every rank maps; see ``Communicator.shared_zeros`` (collective)."""
    return _comm().shared_zeros(shape, dtype)


def barrier(name: Optional[str] = None,
            process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank has called ``barrier()``."""
    _on(process_set, "barrier").barrier(name)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return root_rank's picklable ``obj`` on every rank."""
    c = _on(process_set, "broadcast_object")
    return c.broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Return every rank's picklable ``obj`` as a list in rank order."""
    c = _on(process_set, "allgather_object")
    return c.allgather_object(obj, name)


# ------------------------------------------------------------------ async forms
def allreduce_async(x: Any, op: int = Average, name: Optional[str] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, *,
                    compression: Optional[str] = None) -> Handle:
    """Start an allreduce and return at once; ``synchronize(h)`` returns the new array."""
    c = _on(process_set, "allreduce_async")
    return c.allreduce_async(x, op, name, prescale_factor, postscale_factor,
                             compression=compression)


def allreduce_async_(x: Any, op: int = Average, name: Optional[str] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, *,
                     compression: Optional[str] = None) -> Handle:
    """Start an in-place allreduce of ``x``; ``synchronize(h)`` returns ``x``."""
    c = _on(process_set, "allreduce_async_")
    return c.allreduce_async_(x, op, name, prescale_factor, postscale_factor,
                              compression=compression)


def grouped_allreduce_async(xs: Sequence[Any], op: int = Average, name: Optional[str] = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, *,
                            compression: Optional[str] = None) -> Handle:
    """Start one fused allreduce of all of ``xs``; the result is a list of new arrays."""
    c = _on(process_set, "grouped_allreduce_async")
    return c.grouped_allreduce_async(xs, op, name, prescale_factor, postscale_factor,
                                     compression=compression)


def grouped_allreduce_async_(xs: Sequence[Any], op: int = Average, name: Optional[str] = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place ``grouped_allreduce_async``; the result is the list ``xs``."""
    c = _on(process_set, "grouped_allreduce_async_")
    return c.grouped_allreduce_async_(xs, op, name, prescale_factor, postscale_factor)


def grouped_allreduce(xs: Sequence[Any], op: int = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, *,
                      compression: Optional[str] = None) -> list:
    """Allreduce all of ``xs`` as one fused unit; returns a list of new arrays."""
    return synchronize(grouped_allreduce_async(xs, op, name, prescale_factor, postscale_factor,
                                               process_set=process_set,
                                               compression=compression))


def grouped_allreduce_(xs: Sequence[Any], op: int = Average, name: Optional[str] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    """In-place ``grouped_allreduce``; returns ``xs`` as a list."""
    return synchronize(grouped_allreduce_async_(xs, op, name, prescale_factor,
                                                postscale_factor,
                                               process_set=process_set))


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (Horovod's name); see
    ``Communicator.start_timeline``."""
    _comm().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Close the timeline started by ``start_timeline`` or ``RINGREDUCE_TIMELINE``."""
    _comm().stop_timeline()


def grouped_allgather(xs: Sequence[Any], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather each of ``xs`` (submitted together); see ``Communicator.grouped_allgather``."""
    return _on(process_set, "grouped_allgather").grouped_allgather(xs, name)


def grouped_allgather_async(xs: Sequence[Any], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start a grouped allgather; ``synchronize`` returns the list of results."""
    return _on(process_set, "grouped_allgather_async").grouped_allgather_async(xs, name)


def grouped_reducescatter(xs: Sequence[Any], op: int = Average, name: Optional[str] = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list:
    """Reducescatter each of ``xs`` (submitted together); returns a list."""
    return _on(process_set, "grouped_reducescatter").grouped_reducescatter(
        xs, op, name, prescale_factor, postscale_factor)


def grouped_reducescatter_async(xs: Sequence[Any], op: int = Average,
                                name: Optional[str] = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> Handle:
    """Start a grouped reducescatter; ``synchronize`` returns the list of results."""
    return _on(process_set, "grouped_reducescatter_async").grouped_reducescatter_async(
        xs, op, name, prescale_factor, postscale_factor)


def allgather_async(x: Any, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather; ``synchronize(h)`` returns the concatenation."""
    c = _on(process_set, "allgather_async")
    return c.allgather_async(x, name)


def broadcast_async(x: Any, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast into a new array."""
    c = _on(process_set, "broadcast_async")
    return c.broadcast_async(x, root_rank, name)


def broadcast_async_(x: Any, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast into ``x``."""
    c = _on(process_set, "broadcast_async_")
    return c.broadcast_async_(x, root_rank, name)


def reducescatter_async(x: Any, op: int = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reducescatter."""
    c = _on(process_set, "reducescatter_async")
    return c.reducescatter_async(x, op, name, prescale_factor, postscale_factor)


def alltoall_async(x: Any, splits: Optional[Sequence[int]] = None,
                   name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall."""
    c = _on(process_set, "alltoall_async")
    return c.alltoall_async(x, splits, name)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` (releasing the GIL) and return its result; raises its error."""
    out = handle.wait()
    _release_done()
    return out


def _release_done() -> None:
    """Let the current communicator drop its references to finished collectives."""
    c = _thread.comm or _Process.comm
    if c is not None:
        c.release_done()


def poll(handle: Handle) -> bool:
    """True if ``handle`` has completed; ``synchronize`` will then not block."""
    return handle.done()


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (dynamic sets only); every rank calls it identically, in order.

    Returns the registered ``ProcessSet`` (with its ``process_set_id``).
    """
    return _comm().process_sets.add(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set (dynamic sets only; every rank, in order). True if removed."""
    return _comm().process_sets.remove(process_set)


def join(process_set: Optional[ProcessSet] = None) -> int:
    """Declare that this rank has no more data; returns the last rank to join.

    Until every rank (of ``process_set``, if given) has joined, this rank takes part in
    the other ranks' allreduce / allgather / broadcast (of that set) with neutral
    contributions (zeros for Sum/Average). The rank returned is a global rank, as in
    Horovod, also for a process set.
    """
    return _on(process_set, "join").join()


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
        np: Optional[int] = None, hosts: Any = None, timeout: Optional[float] = None,
        env: Optional[dict] = None, **horovod: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``np`` (default 2) new ranks and return their values in
    rank order (Horovod's ``horovod.run``, whose other arguments, ``num_proc``,
    ``hostfile``, ``use_gloo``..., it takes too; see ``ringreduce._run.run``). ``fn``
    calls ``init()``."""
    from ._run import run as launch  # the launcher is imported only when used

    return launch(fn, args, kwargs, np, hosts, timeout, env, **horovod)
