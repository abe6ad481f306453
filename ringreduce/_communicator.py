"""Communicator: the collectives of one rank, on arrays, over a core Context.

The module-level functions of ``ringreduce`` delegate to the Communicator that
``init()`` creates; tests create several in one process (threads as ranks).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np

from . import _core
from ._arrays import for_reading, for_writing
from ._dtypes import dtype_code
from .exceptions import InvalidInputError, call_label

Sum, Average, Min, Max, Product = 0, 1, 2, 3, 4
_OP_NAMES = {Sum: "Sum", Average: "Average", Min: "Min", Max: "Max", Product: "Product"}



def _check_op(op: int, what: str) -> int:
    if op not in _OP_NAMES:
        raise InvalidInputError(f"{what}: op must be one of ringreduce.Sum, Average, Min, Max, "
                                f"Product; got {op!r}")
    return op


class Handle:
    """A collective in flight. Pass it to ``synchronize()`` or ``poll()``.

    Holds the input and output arrays alive until the collective completes.
    """

    __slots__ = ("_wait", "_done", "_result")

    def __init__(self, wait: Callable[[], Any], done: Callable[[], bool]) -> None:
        self._wait = wait
        self._done = done
        self._result: Any = None

    def done(self) -> bool:
        """True once the collective has completed (successfully or not)."""
        return self._done()

    def wait(self) -> Any:
        """Block until complete (the GIL is released) and return the result; raises on error."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._result = wait()
        return self._result


def _completed(result: Any) -> Handle:
    return Handle(lambda: result, lambda: True)


class Communicator:
    """One rank of a job: rank/size queries and collectives on arrays.

    Parameters
    ----------
    context : ringreduce._core.Context
        A connected core context.
    """

    def __init__(self, context: Any) -> None:
        self._ctx = context
        self._lock = threading.Lock()  # one collective at a time per rank

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

    def transport_to(self, peer: int) -> str:
        """Which transport carries traffic to ``peer``: "shm" or "tcp"."""
        return self._ctx.transport_to(peer)

    def close(self) -> None:
        """Release links and shared memory; the communicator cannot be used afterwards."""
        with self._lock:
            self._ctx.close()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _name(name: Optional[str]) -> str:
        # Unnamed calls are identified by their sequence number in the core,
        # which only advances once local checks pass, so ranks stay in step.
        return "" if name is None else str(name)

    def _call(self, fn: Callable, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    @staticmethod
    def _allocator(dtype: np.dtype, keep: list) -> Callable[[list], int]:
        def alloc(shape: list) -> int:
            out = np.empty(shape, dtype=dtype)
            keep.append(out)
            return out.ctypes.data

        return alloc

    # -------------------------------------------------------------- collectives
    def allreduce_(self, x: Any, op: int = Average, name: Optional[str] = None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
        """Reduce ``x`` across ranks in place and return it (see ``allreduce``)."""
        arr = for_writing(x, "allreduce_", name)
        self._allreduce(arr, arr, op, name, prescale_factor, postscale_factor)
        return x

    def allreduce(self, x: Any, op: int = Average, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
        """Reduce ``x`` element-wise across ranks; return the result as a new array.

        Parameters
        ----------
        x : array-like
            numpy array, DLPack tensor or buffer; same shape and dtype on all ranks.
        op : int
            ``Sum``, ``Average`` (default), ``Min``, ``Max`` or ``Product``.
        name : str, optional
            Names the tensor in error messages; must match across ranks.
        prescale_factor, postscale_factor : float
            Multiply each input before, and the result after, the reduction.

        Returns
        -------
        numpy.ndarray
            Bitwise identical on every rank.
        """
        src = for_reading(x, "allreduce", name)
        out = np.empty_like(src)
        self._allreduce(src, out, op, name, prescale_factor, postscale_factor)
        return out

    def _allreduce(self, src: np.ndarray, out: np.ndarray, op: int, name: Optional[str],
                   prescale: float, postscale: float) -> None:
        # The hot path of small messages: no string formatting unless it fails.
        if op not in _OP_NAMES:
            _check_op(op, call_label("allreduce", name))
        code = dtype_code(src.dtype, "allreduce", name)
        with self._lock:
            self._ctx.allreduce(src, out, src.shape, code, op, prescale, postscale,
                                self._name(name))

    def allgather(self, x: Any, name: Optional[str] = None) -> np.ndarray:
        """Concatenate every rank's ``x`` along axis 0 (its length may differ per rank)."""
        what = call_label("allgather", name)
        src = for_reading(x, what, None)
        keep: list = []
        self._call(self._ctx.allgather, src, list(src.shape),
                   dtype_code(src.dtype, what, None), self._name(name),
                   self._allocator(src.dtype, keep))
        return keep[0]

    def broadcast_(self, x: Any, root_rank: int, name: Optional[str] = None) -> Any:
        """Overwrite ``x`` on every rank with root_rank's ``x``; return it."""
        what = call_label("broadcast_", name)
        arr = for_writing(x, what, None)
        self._call(self._ctx.broadcast, arr, list(arr.shape),
                   dtype_code(arr.dtype, what, None), self._check_root(root_rank, what),
                   self._name(name))
        return x

    def broadcast(self, x: Any, root_rank: int, name: Optional[str] = None) -> np.ndarray:
        """Return a new array holding root_rank's ``x`` on every rank."""
        what = call_label("broadcast", name)
        arr = np.array(for_reading(x, what, None), copy=True)
        return self.broadcast_(arr, root_rank, name)

    def reducescatter(self, x: Any, op: int = Average, name: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
        """Reduce ``x`` across ranks and return this rank's slice of axis 0.

        Axis 0 is split as evenly as possible; lower ranks get the extra rows.
        """
        what = call_label("reducescatter", name)
        src = for_reading(x, what, None)
        keep: list = []
        self._call(self._ctx.reducescatter, src, list(src.shape),
                   dtype_code(src.dtype, what, None), _check_op(op, what), float(prescale_factor),
                   float(postscale_factor), self._name(name),
                   self._allocator(src.dtype, keep))
        return keep[0]

    def alltoall(self, x: Any, splits: Optional[Sequence[int]] = None,
                 name: Optional[str] = None) -> Any:
        """Send ``splits[r]`` rows of ``x`` to rank r; gather what every rank sent here.

        Without ``splits`` axis 0 is divided evenly (it must divide by size) and the
        received array is returned; with ``splits`` a tuple ``(output, received_splits)``.
        """
        what = call_label("alltoall", name)
        src = for_reading(x, what, None)
        if src.ndim == 0:
            raise InvalidInputError(f"{what}: needs at least one dimension")
        given = splits is not None
        if not given:
            if src.shape[0] % self.size():
                raise InvalidInputError(f"{what}: axis 0 ({src.shape[0]}) does not divide by "
                                        f"size {self.size()}; pass splits=")
            splits = [src.shape[0] // self.size()] * self.size()
        keep: list = []
        received = self._call(self._ctx.alltoall, src, list(src.shape),
                              dtype_code(src.dtype, what, None), [int(s) for s in splits],
                              self._name(name), self._allocator(src.dtype, keep))
        return (keep[0], np.asarray(received, dtype=np.int64)) if given else keep[0]

    def barrier(self, name: Optional[str] = None) -> None:
        """Return only after every rank has entered the barrier."""
        self._call(self._ctx.barrier, self._name(name))

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
        """Return root_rank's ``obj`` (any picklable object) on every rank."""
        name = self._name(name)
        payload = pickle.dumps(obj) if self.rank() == root_rank else b""
        length = self.broadcast_(np.array([len(payload)], np.int64), root_rank, name + ".len")
        data = np.frombuffer(payload, np.uint8).copy() if payload else np.empty(
            int(length[0]), np.uint8)
        self.broadcast_(data, root_rank, name + ".data")
        return obj if self.rank() == root_rank else pickle.loads(data.tobytes())

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> list:
        """Return the list of every rank's ``obj``, in rank order."""
        name = self._name(name)
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = self.allgather(np.array([len(data)], np.int64), name + ".len")
        gathered = self.allgather(data, name + ".data")
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        return [pickle.loads(gathered[bounds[i]:bounds[i + 1]].tobytes())
                for i in range(self.size())]

    # -------------------------------------------------------------- async forms
    def allreduce_async(self, x: Any, op: int = Average, name: Optional[str] = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
        """Start ``allreduce``; ``synchronize(handle)`` returns the new array."""
        return _completed(self.allreduce(x, op, name, prescale_factor, postscale_factor))

    def allreduce_async_(self, x: Any, op: int = Average, name: Optional[str] = None,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
        """Start an in-place ``allreduce_``; ``synchronize(handle)`` returns ``x``."""
        return _completed(self.allreduce_(x, op, name, prescale_factor, postscale_factor))

    def grouped_allreduce_async(self, xs: Sequence[Any], op: int = Average,
                                name: Optional[str] = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
        """Start one fused allreduce of several arrays; the result is a list of new arrays."""
        base = "grouped" if name is None else name
        return _completed([self.allreduce(x, op, f"{base}.{i}", prescale_factor,
                                          postscale_factor) for i, x in enumerate(xs)])

    def grouped_allreduce_async_(self, xs: Sequence[Any], op: int = Average,
                                 name: Optional[str] = None, prescale_factor: float = 1.0,
                                 postscale_factor: float = 1.0) -> Handle:
        """In-place form of ``grouped_allreduce_async``; the result is ``xs`` as a list."""
        base = "grouped" if name is None else name
        return _completed([self.allreduce_(x, op, f"{base}.{i}", prescale_factor,
                                           postscale_factor) for i, x in enumerate(xs)])

    def allgather_async(self, x: Any, name: Optional[str] = None) -> Handle:
        """Start ``allgather``."""
        return _completed(self.allgather(x, name))

    def broadcast_async(self, x: Any, root_rank: int, name: Optional[str] = None) -> Handle:
        """Start ``broadcast`` (new array)."""
        return _completed(self.broadcast(x, root_rank, name))

    def broadcast_async_(self, x: Any, root_rank: int, name: Optional[str] = None) -> Handle:
        """Start an in-place ``broadcast_``."""
        return _completed(self.broadcast_(x, root_rank, name))

    def reducescatter_async(self, x: Any, op: int = Average, name: Optional[str] = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Handle:
        """Start ``reducescatter``."""
        return _completed(self.reducescatter(x, op, name, prescale_factor, postscale_factor))

    def alltoall_async(self, x: Any, splits: Optional[Sequence[int]] = None,
                       name: Optional[str] = None) -> Handle:
        """Start ``alltoall``."""
        return _completed(self.alltoall(x, splits, name))

    def join(self) -> int:
        """Declare this rank out of data; returns the last rank to join."""
        self.barrier("join")
        return self.size() - 1

    def _check_root(self, root_rank: int, what: str) -> int:
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self.size():
            raise InvalidInputError(f"{what}: root_rank must be an int in [0, {self.size()}), "
                                    f"got {root_rank!r}")
        return int(root_rank)


def reduce_isa() -> str:
    """Instruction set the reduction kernels use on this CPU."""
    return _core.reduce_isa()
