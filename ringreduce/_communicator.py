"""Communicator: the collectives of one rank, on arrays, over a core Context.

The module-level functions of ``ringreduce`` delegate to the Communicator that
``init()`` creates; tests create several in one process (threads as ranks).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import numpy as np

from . import _core
from ._adasum import Adasum
from ._arrays import for_reading, for_writing
from ._call_checks import _OP_NAMES, Average, _check_op, check_scales
from ._composite_calls import CompositeCalls
from ._cuda_arrays import is_gpu_array
from ._dtypes import dtype_code
from ._gpu import configure_engine
from ._gpu_calls import GpuCalls
from ._gpu_collectives import GpuCollectives
from ._handles import Handle, _oldest_done
from ._pool import OutputPool
from ._refusals import is_reported, mark_reported, name_rank
from .exceptions import InvalidInputError, call_label


class Communicator(GpuCalls, CompositeCalls):
    """One rank of a job: rank/size queries and collectives on arrays.

    Every collective goes through the rank's background engine (C++): the
    ``*_async`` forms return a :class:`Handle` at once, the others wait for it.

    Parameters
    ----------
    context : ringreduce._core.Context
        A connected core context.
    rendezvous : optional
        Rank 0's rendezvous store server, kept up (the port stays taken, so a
        second job on it is refused) and closed with the communicator.
    """

    def __init__(self, context: Any, rendezvous: Any = None) -> None:
        from .process_sets import ProcessSetRegistry

        self._ctx = context
        self._rendezvous = rendezvous
        self._engine = _core.Engine(context)
        configure_engine(self._engine)
        self._gpu = GpuCollectives(self._engine, context.rank)
        self._init_calls()
        self.process_sets = ProcessSetRegistry(self)

    def _init_calls(self) -> None:
        """State of the calls made through this communicator (not shared with views)."""
        self._lock = threading.Lock()
        self._in_flight: deque[Handle] = deque()  # keeps buffers alive until complete
        self._prune_at = 64
        self._groups = 0  # unnamed grouped calls in the join epoch _groups_epoch
        self._groups_epoch = 0
        self._close_lock = threading.Lock()
        self._closed = False
        # Warm memory for large out-of-place results (see _pool); bytes kept at most.
        self._outputs = OutputPool(int(os.environ.get("RINGREDUCE_OUTPUT_POOL_BYTES",
                                                      256 << 20)))

    # ------------------------------------------------------------------ queries
    def rank(self) -> int:
        """This process's rank in [0, size)."""
        return self._ctx.rank

    def size(self) -> int:
        """Number of ranks in the job."""
        return self._ctx.size

    def local_rank(self) -> int:
        """Rank among the ranks on this host."""
        return self._ctx.local_rank

    def local_size(self) -> int:
        """Number of ranks on this host."""
        return self._ctx.local_size

    def cross_rank(self) -> int:
        """Index of this host among the job's hosts."""
        return self._ctx.cross_rank

    def cross_size(self) -> int:
        """Number of hosts in the job."""
        return self._ctx.cross_size

    def is_homogeneous(self) -> bool:
        """Whether every host of the job runs as many ranks as the others."""
        return len({len(ranks) for ranks in self._ctx.hosts}) == 1

    def transport_to(self, peer: int) -> str:
        """Which transport carries traffic to ``peer``: "shm" or "tcp"."""
        return self._ctx.transport_to(peer)

    def close(self) -> None:
        """Stop the engine, release links and shared memory; pending calls fail.

        Safe to call from several threads and more than once.
        """
        with self._close_lock:
            if self._closed:
                return
            self._engine.shutdown()
            self._ctx.close()
            if self._rendezvous is not None:
                self._rendezvous.close()
            self._closed = True

    # ------------------------------------------------------------------ helpers
    def _track(self, core: Any, finish: Callable[[Any], Any], keep: tuple) -> Handle:
        h = Handle(core, finish, keep)
        self._keep_alive(h)
        return h

    def _keep_alive(self, h: Any) -> None:
        # The deque keeps a handle (and through it the caller's buffers) alive
        # while its collective runs, even if the caller drops it. Appends need
        # no lock (deque.append is atomic); only the left end is pruned, under
        # the lock. Handles finish roughly in submission order, so pruning
        # whenever the oldest one is done, and after every wait (release_done),
        # keeps no finished gradient or result alive for long; one handle
        # still in flight keeps the ones behind it until it finishes, and the
        # length cap bounds how often such a queue is rescanned.
        q = self._in_flight
        q.append(h)
        if len(q) >= self._prune_at or _oldest_done(q):
            self.release_done()

    def release_done(self) -> None:
        """Drop the keep-alive references of finished collectives (cheap; after waits)."""
        q = self._in_flight
        with self._lock:
            while q and q[0].done():
                q.popleft()
            self._prune_at = len(q) + 64

    def _wait(self, h: Handle) -> Any:
        """A blocking call's end: its result, with its keep-alive reference dropped."""
        out = h.wait()
        self.release_done()
        return out

    @staticmethod
    def _output(dtype: np.dtype) -> Callable[[Any], np.ndarray]:
        return lambda core: core.output(0).view(dtype).reshape(core.output_shape(0))

    # -------------------------------------------------------------- allreduce
    def allreduce_async_(self, x: Any, op: int = Average, name: Optional[str] = None,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                         compression: Optional[str] = None) -> Handle:
        """Start an in-place allreduce of ``x``; ``synchronize(handle)`` returns ``x``."""
        if compression not in (None, "none"):
            return self._compressed([x], True, op, name, prescale_factor, postscale_factor,
                                    "allreduce_", lambda outs: x, compression)
        # The per-gradient hot path: a plain numpy array is checked in C++ and
        # its handle (a _core.ArrayHandle: wait() returns x) made there too.
        if op is Adasum:
            return self._adasum([x], name, prescale_factor, postscale_factor, True, False)
        h = self._engine.allreduce_array(x, op, name, prescale_factor, postscale_factor)
        if h is not None:  # _keep_alive, inlined: one Python frame less per gradient
            # Only the length cap here (a check of the oldest handle costs every
            # gradient a call): DistributedOptimizer, rr.synchronize and the blocking
            # calls release finished handles after their waits.
            q = self._in_flight
            q.append(h)
            if len(q) >= self._prune_at:
                self.release_done()
            return h
        if is_gpu_array(x):
            return self._gpu_allreduce([x], True, op, name, prescale_factor, postscale_factor,
                                       "allreduce_", lambda outs: x)
        with self._refusing("allreduce", name):
            arr = for_writing(x, "allreduce_", name)
        core = self._submit_allreduce(arr, arr, op, name, prescale_factor, postscale_factor,
                                      "allreduce_")
        return self._track(core, lambda _: x, (arr,))

    def allreduce_async(self, x: Any, op: int = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                        compression: Optional[str] = None) -> Handle:
        """Start an allreduce; ``synchronize(handle)`` returns the result as a new array."""
        if compression not in (None, "none"):
            return self._compressed([x], False, op, name, prescale_factor, postscale_factor,
                                    "allreduce", lambda outs: outs[0], compression)
        if op is Adasum:
            return self._adasum([x], name, prescale_factor, postscale_factor, False, False)
        if is_gpu_array(x):
            return self._gpu_allreduce([x], False, op, name, prescale_factor, postscale_factor,
                                       "allreduce", lambda outs: outs[0])
        with self._refusing("allreduce", name):
            src = for_reading(x, "allreduce", name)
        out = self._outputs.empty_like(src)
        core = self._submit_allreduce(src, out, op, name, prescale_factor, postscale_factor,
                                      "allreduce")
        return self._track(core, lambda _: out, (src, out))

    def _now(self, x: Any, op: Any, name: Optional[str], pre: Any, post: Any,
             in_place: bool) -> Any:
        """The blocking hot path (metrics, losses): a plain numpy array is checked,
        submitted and waited for in one C++ call with no handle kept; an out-of-place
        result is allocated there up to the size from which the output pool keeps warm
        memory. None: the general path must take the call."""
        out = self._engine.allreduce_array_now(x, op, name, pre, post, self._in_flight,
                                               in_place, self._outputs.min_bytes - 1)
        return None if out is None else self._released(out)

    def _released(self, out: Any) -> Any:
        """A blocking fast path's result (``*_array_now``: a plain numpy array checked,
        submitted and waited for in one C++ call, no handle kept), after dropping the
        keep-alive references of asynchronous calls that finished meanwhile."""
        if self._in_flight:
            self.release_done()
        return out

    def allreduce_(self, x: Any, op: int = Average, name: Optional[str] = None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                   compression: Optional[str] = None) -> Any:
        """Reduce ``x`` across ranks in place and return it (see ``allreduce``)."""
        if compression is None and op is not Adasum:
            done = self._now(x, op, name, prescale_factor, postscale_factor, True)
            if done is not None:
                return done
        return self._wait(self.allreduce_async_(x, op, name, prescale_factor, postscale_factor,
                                                compression=compression))

    def allreduce(self, x: Any, op: int = Average, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                  compression: Optional[str] = None) -> np.ndarray:
        """Reduce ``x`` element-wise across ranks; return the result as a new array.

        Parameters
        ----------
        x : array-like
            numpy array, DLPack tensor or buffer; same shape and dtype on all ranks.
        op : int
            ``Sum``, ``Average`` (default), ``Min``, ``Max`` or ``Product``.
        name : str, optional
            Identifies the tensor across ranks (ranks may submit in different
            orders); unnamed calls are matched by their order.
        prescale_factor, postscale_factor : float
            Multiply each input before, and the result after, the reduction.
        compression : {None, 'fp16', 'bf16'}, optional
            GPU arrays only: float32 / float64 arrays travel as float16 / bfloat16, cast
            by the GPU executor's kernels (scales folded into the casts); other dtypes
            travel as they are. Ranks must agree. Host arrays refuse it (the framework
            layers' ``Compression`` casts them).

        Returns
        -------
        numpy.ndarray
            Bitwise identical on every rank.
        """
        if compression is None and op is not Adasum:
            out = self._now(x, op, name, prescale_factor, postscale_factor, False)
            if out is not None:
                return out
        return self._wait(self.allreduce_async(x, op, name, prescale_factor, postscale_factor,
                                               compression=compression))

    def _compressed(self, xs: Sequence[Any], in_place: bool, op: Any, name: Optional[str],
                    prescale: Any, postscale: Any, what: str, result: Callable[[list], Any],
                    compression: str, grouped: bool = False) -> Handle:
        """An allreduce with ``compression``: GPU arrays through the executor's casts;
        host arrays refuse it, and so does Adasum."""
        if xs and all(is_gpu_array(x) for x in xs) and op is not Adasum:
            return self._gpu_allreduce(xs, in_place, op, name, prescale, postscale, what,
                                       result, grouped, compression)
        refusing = self._refusing_group(name, xs) if grouped else self._refusing(
            "allreduce", name)
        with refusing:
            raise InvalidInputError(
                f"{call_label(what, name)}: compression= applies to GPU arrays (cast on the "
                "device) and not to Adasum; host arrays are compressed by a framework "
                "layer's Compression")

    def _submit_allreduce(self, src: np.ndarray, out: np.ndarray, op: int, name: Optional[str],
                          prescale: float, postscale: float, what: str) -> Any:
        # The hot path of small messages: no string formatting unless it fails.
        try:  # not _refusing(): a plain try costs nothing when nothing fails
            if op is not Adasum and (type(op) is not int or op not in _OP_NAMES):
                op = _check_op(op, call_label(what, name))
            code = dtype_code(src.dtype, what, name)
            pre, post = check_scales(prescale, postscale, what, name)
        except InvalidInputError as err:
            self._refuse("allreduce", name, err)
            raise
        return self._engine.allreduce(src, out, src.shape, code, op, pre, post,
                                      self._name(name))

    def grouped_allreduce_async(self, xs: Sequence[Any], op: int = Average,
                                name: Optional[str] = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, *,
                                compression: Optional[str] = None) -> Handle:
        """Start one fused allreduce of all of ``xs``; the result is a list of new arrays."""
        if compression not in (None, "none"):
            return self._compressed(xs, False, op, name, prescale_factor, postscale_factor,
                                    "grouped_allreduce", list, compression, grouped=True)
        if op is Adasum:
            return self._adasum(xs, name, prescale_factor, postscale_factor, False, True)
        if any(is_gpu_array(x) for x in xs):
            return self._gpu_allreduce(xs, False, op, name, prescale_factor, postscale_factor,
                                       "grouped_allreduce", list, grouped=True)
        with self._refusing_group(name, xs):
            srcs = [for_reading(x, "grouped_allreduce", name) for x in xs]
            outs = [self._outputs.empty_like(s) for s in srcs]
            core = self._submit_group(srcs, outs, op, name, prescale_factor, postscale_factor)
        return self._track(core, lambda _: outs, (srcs, outs))

    def grouped_allreduce(self, xs: Sequence[Any], op: int = Average,
                          name: Optional[str] = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, *,
                          compression: Optional[str] = None) -> list:
        """Allreduce all of ``xs`` as one fused unit; returns a list of new arrays."""
        return self._wait(self.grouped_allreduce_async(xs, op, name, prescale_factor,
                                                       postscale_factor,
                                                       compression=compression))

    def grouped_allreduce_async_(self, xs: Sequence[Any], op: int = Average,
                                 name: Optional[str] = None, prescale_factor: float = 1.0,
                                 postscale_factor: float = 1.0) -> Handle:
        """In-place form of ``grouped_allreduce_async``; the result is ``xs`` as a list."""
        if op is Adasum:
            return self._adasum(xs, name, prescale_factor, postscale_factor, True, True)
        if any(is_gpu_array(x) for x in xs):
            return self._gpu_allreduce(xs, True, op, name, prescale_factor, postscale_factor,
                                       "grouped_allreduce_", list, grouped=True)
        if type(xs) in (list, tuple) and (name is None or type(name) is str):
            # Plain numpy arrays are checked and submitted in C++ (None: some member
            # needs the general path below, which converts or raises). The tuple is
            # what keeps them alive until the collective completes.
            keep = tuple(xs)
            with self._lock:
                group = self._group_name(name)
                core = self._engine.grouped_allreduce_arrays(keep, op, group, prescale_factor,
                                                             postscale_factor)
                self._groups += core is not None and name is None
            if core is not None:
                return self._track(core, lambda _: list(keep), (keep,))
        with self._refusing_group(name, xs):
            arrs = [for_writing(x, "grouped_allreduce_", name) for x in xs]
            core = self._submit_group(arrs, arrs, op, name, prescale_factor, postscale_factor)
        return self._track(core, lambda _: list(xs), (arrs,))

    def _group_name(self, name: Optional[str]) -> str:
        """The group's name: ``name``, or the next deterministic one (hold ``_lock``)."""
        if name is not None:
            return name
        # The engine's count of completed join()s, not one kept here: a join()
        # interrupted by Ctrl-C still completes in the engine, as on the peers.
        epoch = self._engine.join_epoch()
        if epoch != self._groups_epoch:
            self._groups_epoch, self._groups = epoch, 0
        prefix = f"{epoch}." if epoch else ""
        return f"grouped_allreduce.noname.{prefix}{self._groups}"

    def _submit_group(self, srcs: list, outs: list, op: int, name: Optional[str],
                      prescale: float, postscale: float) -> Any:
        what = call_label("grouped_allreduce", name)
        op = op if op is Adasum else _check_op(op, what)
        if not srcs:
            raise InvalidInputError(f"{what}: needs at least one array")
        codes = [dtype_code(s.dtype, what, None) for s in srcs]
        pre, post = check_scales(prescale, postscale, "grouped_allreduce", name)
        with self._lock:  # the counter advances only when the engine took the group
            group = self._group_name(name)
            names = [f"{group}.{i}" for i in range(len(srcs))]
            core = self._engine.grouped_allreduce(srcs, outs, [list(s.shape) for s in srcs],
                                                  codes, names, op, pre, post, str(group))
            self._groups += name is None
        return core

    # ------------------------------------------------------ other collectives
    def allgather_async(self, x: Any, name: Optional[str] = None) -> Handle:
        """Start an allgather; the result concatenates every rank's ``x`` along axis 0."""
        if is_gpu_array(x):
            return self._gpu_allgather([x], name)
        what = call_label("allgather", name)
        with self._refusing("allgather", name):
            src = for_reading(x, what, None)
            code = dtype_code(src.dtype, what, None)
        core = self._engine.allgather(src, list(src.shape), code, self._name(name))
        return self._track(core, self._output(src.dtype), (src,))

    def allgather(self, x: Any, name: Optional[str] = None) -> np.ndarray:
        """Concatenate every rank's ``x`` along axis 0 (its length may differ per rank)."""
        out = self._engine.allgather_array_now(x, name, self._in_flight)
        if out is not None:
            return self._released(out)
        return self._wait(self.allgather_async(x, name))

    def broadcast_async_(self, x: Any, root_rank: int, name: Optional[str] = None) -> Handle:
        """Start overwriting ``x`` with root_rank's ``x``; the result is ``x``."""
        if is_gpu_array(x):
            return self._gpu_broadcast(x, True, root_rank, name, "broadcast_")
        return self._broadcast(x, root_rank, name, "broadcast_")

    def broadcast_async(self, x: Any, root_rank: int, name: Optional[str] = None) -> Handle:
        """Start a broadcast into a new array."""
        if is_gpu_array(x):
            return self._gpu_broadcast(x, False, root_rank, name, "broadcast")
        return self._broadcast(x, root_rank, name, "broadcast")

    def _broadcast(self, x: Any, root_rank: int, name: Optional[str], op: str) -> Handle:
        """``broadcast_`` overwrites ``x``; ``broadcast`` a copy (errors name the one called)."""
        what = call_label(op, name)
        with self._refusing("broadcast", name):
            if op == "broadcast_":
                arr = for_writing(x, what, None)
            else:
                src = for_reading(x, what, None)
                arr = self._outputs.empty_like(src)
                arr[...] = src
            code = dtype_code(arr.dtype, what, None)
            root = self._check_root(root_rank, what)
        core = self._engine.broadcast(arr, list(arr.shape), code, root, self._name(name))
        return self._track(core, (lambda _: x) if op == "broadcast_" else (lambda _: arr), (arr,))

    def broadcast_(self, x: Any, root_rank: int, name: Optional[str] = None) -> Any:
        """Overwrite ``x`` on every rank with root_rank's ``x``; return it."""
        out = self._engine.broadcast_array_now(x, root_rank, name, self._in_flight, True, 0)
        if out is not None:
            return self._released(out)
        return self._wait(self.broadcast_async_(x, root_rank, name))

    def broadcast(self, x: Any, root_rank: int, name: Optional[str] = None) -> np.ndarray:
        """Return a new array holding root_rank's ``x`` on every rank."""
        out = self._engine.broadcast_array_now(x, root_rank, name, self._in_flight, False,
                                               self._outputs.min_bytes - 1)
        if out is not None:
            return self._released(out)
        return self._wait(self.broadcast_async(x, root_rank, name))

    def reducescatter_async(self, x: Any, op: int = Average, name: Optional[str] = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Handle:
        """Start a reducescatter (see ``reducescatter``)."""
        what = call_label("reducescatter", name)
        if is_gpu_array(x):
            return self._gpu_reducescatter(x, op, name, prescale_factor, postscale_factor)
        with self._refusing("reducescatter", name):
            src = for_reading(x, what, None)
            code = dtype_code(src.dtype, what, None)
            op = _check_op(op, what)
            scales = check_scales(prescale_factor, postscale_factor, "reducescatter", name)
        core = self._engine.reducescatter(src, list(src.shape), code, op, *scales,
                                          self._name(name))
        return self._track(core, self._output(src.dtype), (src,))

    def reducescatter(self, x: Any, op: int = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
        """Reduce ``x`` across ranks and return this rank's slice of axis 0.

        Axis 0 is split as evenly as possible; lower ranks get the extra rows.
        """
        return self._wait(self.reducescatter_async(x, op, name, prescale_factor, postscale_factor))

    def alltoall_async(self, x: Any, splits: Optional[Sequence[int]] = None,
                       name: Optional[str] = None) -> Handle:
        """Start an alltoall (see ``alltoall``)."""
        if is_gpu_array(x):
            return self._gpu_alltoall(x, splits, name)
        what = call_label("alltoall", name)
        given = splits is not None
        with self._refusing("alltoall", name):
            src = for_reading(x, what, None)
            if src.ndim == 0:
                raise InvalidInputError(f"{what}: needs at least one dimension")
            if not given:
                if src.shape[0] % self.size():
                    raise InvalidInputError(f"{what}: axis 0 ({src.shape[0]}) does not divide "
                                            f"by size {self.size()}; pass splits=")
                splits = [src.shape[0] // self.size()] * self.size()
            code = dtype_code(src.dtype, what, None)
            splits = [int(s) for s in splits]
        core = self._engine.alltoall(src, list(src.shape), code, splits, self._name(name))
        out = self._output(src.dtype)

        def finish(c: Any) -> Any:
            return (out(c), np.asarray(c.received_splits, dtype=np.int64)) if given else out(c)

        return self._track(core, finish, (src,))

    def alltoall(self, x: Any, splits: Optional[Sequence[int]] = None,
                 name: Optional[str] = None) -> Any:
        """Send ``splits[r]`` rows of ``x`` to rank r; gather what every rank sent here.

        Without ``splits`` axis 0 is divided evenly (it must divide by size) and the
        received array is returned; with ``splits`` a tuple ``(output, received_splits)``.
        """
        return self._wait(self.alltoall_async(x, splits, name))

    def shared_zeros(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """Return a zero-filled array in memory that every rank of this host maps.

        Collective: every rank calls it in the same order with the same shape
        and dtype (as MPI's ``MPI_Win_allocate_shared``). An allreduce whose
        tensors all lie in one such buffer, at the same offsets on every rank
        (views of it, such as a model's gradients laid out in one flat buffer),
        reads the other ranks' data where it lies instead of passing it through
        the transport: about half the memory traffic of the ring. When the job
        spans hosts, each host's ranks share theirs and such an allreduce runs
        hierarchically (reduced in each host where the data lies, a ring across
        hosts, the result written into the host's buffers) where the
        hierarchical allreduce is chosen; with ``RINGREDUCE_TRANSPORT=tcp`` this
        is an ordinary private ``np.zeros`` and collectives over it take the ring.

        Parameters
        ----------
        shape : int or sequence of int
            Shape of the array.
        dtype : numpy dtype, optional
            Element type (float32).

        Returns
        -------
        numpy.ndarray
            A writable C-contiguous array; the memory lives as long as any view
            of it does.

        Raises
        ------
        MismatchError
            If the ranks asked for different sizes.
        """
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise InvalidInputError(f"rank {self.rank()}: shared_zeros: dtype {dt} holds Python "
                                    "objects, which cannot live in shared memory")
        dims = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise InvalidInputError(f"rank {self.rank()}: shared_zeros: negative dimension in "
                                    f"shape {dims}")
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        buf = self._engine.create_shared(nbytes)
        if buf is None or nbytes == 0:
            return np.zeros(dims, dt)
        return np.frombuffer(buf, np.uint8, count=nbytes).view(dt).reshape(dims)

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Start writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it; on
        other ranks this does nothing), as ``RINGREDUCE_TIMELINE`` does from the start.

        A trace already open is closed first. ``mark_cycles`` (Horovod's) adds an instant
        event ``CYCLE_START`` across all rows at the start of every negotiation round.
        """
        self._engine.start_timeline(os.fspath(file_path), bool(mark_cycles))

    def stop_timeline(self) -> None:
        """Close the timeline (the file is then complete, strict JSON); harmless if none."""
        self._engine.stop_timeline()

    def barrier(self, name: Optional[str] = None) -> None:
        """Return only after every rank has entered the barrier."""
        self._engine.barrier(self._name(name)).wait()

    def join(self) -> int:
        """Declare that this rank has no more data; returns the last rank to join.

        Until every rank has joined, this rank's engine takes part in the other
        ranks' allreduce / allgather / broadcast with neutral contributions.
        """
        core = self._engine.join(self._gpu.join_device(self.local_rank()))
        core.wait()
        return core.join_result

    @contextlib.contextmanager
    def _refusing(self, kind: str, name: Optional[str]) -> Iterator[None]:
        """Checks of a call of ``kind`` run inside: if one refuses the call, rank 0 hears of
        it (``Engine.reject``) and the other ranks' calls of that name raise at once, naming
        this rank and the error, instead of waiting for this rank forever."""
        try:
            yield
        except InvalidInputError as err:
            self._refuse(kind, name, err)
            raise

    @contextlib.contextmanager
    def _refusing_group(self, name: Optional[str], xs: Any) -> Iterator[None]:
        """``_refusing`` for a grouped allreduce: each member's name is refused (the group's
        next name, when unnamed, is used up as by a submitted group)."""
        try:
            yield
        except InvalidInputError as err:
            self._refuse_group(name, xs, err)
            raise

    def _refuse_group(self, name: Optional[str], xs: Any, err: Exception) -> None:
        if is_reported(err):
            return
        count = len(xs) if isinstance(xs, Sequence) else 0
        with self._lock:
            group = self._group_name(name)
            self._groups += name is None
        self._refuse_each("allreduce", [f"{group}.{i}" for i in range(count)], err)

    def _refuse_each(self, kind: str, names: list, err: Exception) -> None:
        """``_refuse`` for a call made of several collectives of ``kind``, none submitted."""
        if is_reported(err):
            return
        mark_reported(err)
        why = name_rank(err, self._who())
        for name in names:
            self._engine.reject(kind, self._name(name), why)

    def _refuse(self, kind: str, name: Optional[str], err: Exception) -> None:
        if not is_reported(err):  # once: a second report would skip an unnamed call's name
            mark_reported(err)
            self._engine.reject(kind, self._name(name), name_rank(err, self._who()))

    @staticmethod
    def _name(name: Optional[str]) -> str:
        # Unnamed calls get "noname.<n>" in the engine ("noname.<e>.<n>" after
        # the e-th join()), which matches across ranks as long as they make
        # unnamed calls in one order between joins.
        return "" if name is None else str(name)

    def _check_root(self, root_rank: int, what: str) -> int:
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self.size():
            raise InvalidInputError(f"{what}: root_rank must be an int in [0, {self.size()})"
                                    f"{self._root_scope()}, got {root_rank!r}")
        return int(root_rank)

    def _who(self) -> str:
        """This rank as its errors name it (``rank <who>: ...``)."""
        return str(self.rank())

    def _root_scope(self) -> str:
        return ""


class ProcessSetCommunicator(Communicator):
    """The collectives of one process set (``ringreduce.ProcessSet``), as seen by a member:
    ``rank()`` and ``size()`` count the set's ranks, root ranks are ranks of the set (as in
    Horovod), and every call negotiates and moves data among the members only, over the
    job's existing links. Made by ``ProcessSetRegistry``; closing the job closes it.

    Parameters
    ----------
    parent : Communicator
        The job's communicator on this rank.
    members : list of int
        The set's global ranks, ascending, this rank among them.
    """

    def __init__(self, parent: Communicator, members: list[int]) -> None:
        self._ctx = parent._ctx
        self._rendezvous = None
        self._engine = parent._engine.process_set(members)
        self._gpu = GpuCollectives(parent._engine, parent.rank(), members)
        self._init_calls()
        self._members = list(members)
        self._rank = self._members.index(parent.rank())
        self.process_sets = parent.process_sets

    def rank(self) -> int:
        """This process's rank within the set."""
        return self._rank

    def _who(self) -> str:
        # errors name the job's rank, as the engine's do, and the set's for its root ranks
        return f"{self._members[self._rank]} (rank {self._rank} of process set {self._members})"

    def _root_scope(self) -> str:
        return " (a rank of the process set, as in Horovod)"

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self._members)

    def close(self) -> None:
        """Nothing to release: the job's communicator owns the engine and the links."""

    def shared_zeros(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """Not for process sets: shared buffers are mapped by every rank of the job."""
        raise InvalidInputError("shared_zeros is collective over the whole job; call it "
                                "without a process set")








def reduce_isa() -> str:
    """Instruction set the reduction kernels use on this CPU."""
    return _core.reduce_isa()
