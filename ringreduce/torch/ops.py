"""Collectives on torch tensors, with the signatures of ``horovod.torch``.

Results are torch tensors of the input's dtype. Out-of-place ``allreduce``,
``allgather``, ``broadcast``, ``reducescatter`` and ``alltoall`` are
differentiable, with Horovod's gradients (``ringreduce._grads``): allreduce's backward
is the same allreduce of the gradient, allgather's is this rank's slice of the averaged
gradient, broadcast's is the average of the gradients on the root and zero elsewhere,
reducescatter's gathers the gradient back (times size for Sum).

The ``*_async`` forms return a ``Handle``; ``synchronize(handle)`` returns the
result (a torch tensor) and ``poll(handle)`` tells whether it is ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

import ringreduce as _rr
from ringreduce import Average, Communicator, Max, Min, Product, Sum
from ringreduce._call_checks import check_scales
from ringreduce._horovod import resolve_op as _resolve_op
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._tensors import binder, check_tensor, comm, label, refusals, to_numpy, to_torch
from .compression import Compression, Compressor, device_compression

_OPS = {Sum: "Sum", Average: "Average", Min: "Min", Max: "Max", Product: "Product"}
Splits = Optional[Union[Sequence[int], torch.Tensor]]


class Handle:
    """A collective in flight; pass it to ``synchronize()`` or ``poll()``.

    Wraps a ``ringreduce.Handle`` and turns its numpy result into torch tensors.
    """

    __slots__ = ("_inner", "_finish", "_result", "_pending")

    def __init__(self, inner: Any, finish: Callable[[Any], Any]) -> None:
        self._inner = inner
        self._finish = finish
        self._result: Any = None
        self._pending = True

    def done(self) -> bool:
        """True once the collective has completed; ``wait()`` will not block."""
        return not self._pending or self._inner.done()

    def wait(self) -> Any:
        """Block until complete and return the result; raises the collective's error
        (again on every later call, as the numpy-level handle does)."""
        if self._pending:
            result = self._finish(self._inner.wait())  # raises; then _pending stays
            self._pending, self._result, self._finish = False, result, None
        return self._result


def synchronize(handle: Any) -> Any:
    """Wait for ``handle`` and return its result (torch tensors for ringreduce.torch calls)."""
    out = handle.wait()
    _rr._release_done()
    return out


def poll(handle: Any) -> bool:
    """True if ``handle`` has completed (``synchronize`` will then not block)."""
    return handle.done()


def resolve_op(average: Any, op: Optional[int], what: str) -> int:
    """The reduction op from Horovod's ``average=`` flag or ``op=`` (see ``_horovod``)."""
    return _resolve_op(average, op, what, "ringreduce.torch")


def _writable(t: torch.Tensor, what: str) -> tuple[np.ndarray, Callable[[Any], torch.Tensor]]:
    """A C-contiguous array over ``t`` and a function that finishes an in-place op on it.

    Non-contiguous tensors go through a contiguous copy that is copied back.
    """
    check_tensor(t, what)
    if t.is_contiguous():
        return to_numpy(t, what), lambda _: t
    buf = t.detach().contiguous()

    def copy_back(_: Any) -> torch.Tensor:
        with torch.no_grad():
            t.copy_(buf)
        return t

    return to_numpy(buf, what), copy_back


def _new_tensor(result: Any) -> torch.Tensor:
    return to_torch(result)


# ------------------------------------------------------------- allreduce
def _allreduce_now(c: Communicator, tensor: torch.Tensor, op: int, name: Optional[str],
                   compression: type[Compressor], pre: float, post: float) -> torch.Tensor:
    what = label("allreduce", name)
    if compression is Compression.none and isinstance(tensor, torch.Tensor) and tensor.is_cpu:
        return to_torch(c.allreduce(to_numpy(tensor, what), op, name, pre, post))  # metrics
    tensor = check_tensor(tensor, what).detach()
    wire = device_compression(compression, tensor)
    if wire:  # a CUDA tensor: the GPU executor casts in its fusion kernels
        return to_torch(c.allreduce(to_numpy(tensor, what), op, name, pre, post,
                                    compression=wire))
    compressed, ctx = compression.compress(tensor)
    out = c.allreduce(to_numpy(compressed, what), op, name, pre, post)
    return compression.decompress(to_torch(out), ctx)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, name: Optional[str],
                compression: type[Compressor], pre: float, post: float,
                get_comm: Callable[[], Communicator]) -> torch.Tensor:
        ctx.args = (op, name, compression, pre, post, get_comm)
        return _allreduce_now(get_comm(), tensor, op, name, compression, pre, post)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, name, compression, pre, post, get_comm = ctx.args
        if op not in (Sum, Average):
            raise InvalidInputError(f"{label('allreduce', name)}: op {_OPS[op]} has no gradient;"
                                    " only Sum and Average are differentiable")
        gname = f"{name}.grad" if name else None
        g = _allreduce_now(get_comm(), grad.contiguous(), op, gname, compression, pre, post)
        return g, None, None, None, None, None, None


@refusals("allreduce")
def allreduce(tensor: torch.Tensor, average: Any = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks; return a new tensor (differentiable for Sum/Average).

    Parameters
    ----------
    tensor : torch.Tensor
        CPU tensor with the same shape and dtype on every rank.
    average : bool, optional
        Horovod's deprecated flag (True: Average, False: Sum); prefer ``op``.
    name : str, optional
        Identifies the tensor across ranks (must match) and in error messages.
    compression : Compressor, optional
        ``Compression.none`` (default), ``Compression.fp16`` or ``Compression.bf16``.
    op : int, optional
        ``Sum``, ``Average`` (default), ``Min``, ``Max`` or ``Product``.
    prescale_factor, postscale_factor : float
        Multiply each input before, and the result after, the reduction.

    Returns
    -------
    torch.Tensor
        Identical on every rank.
    """
    op = resolve_op(average, op, label("allreduce", name))
    if torch.is_grad_enabled() and check_tensor(tensor, "allreduce").requires_grad:
        return _AllreduceFn.apply(tensor, op, name, compression,
                                  *check_scales(prescale_factor, postscale_factor, "allreduce",
                                                name), binder(process_set))
    return _allreduce_now(comm(process_set), tensor, op, name, compression, prescale_factor,
                          postscale_factor)


@refusals("allreduce")
def allreduce_(tensor: torch.Tensor, average: Any = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place (not tracked by autograd) and return it."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.is_contiguous():
        # The blocking hot path (metrics): the numpy view reduced in one C++ call.
        what = label("allreduce_", name)
        comm(process_set).allreduce_(to_numpy(tensor, what), resolve_op(average, op, what),
                                     name, prescale_factor, postscale_factor)
        return tensor
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set=process_set))


@refusals("allreduce")
def allreduce_async(tensor: torch.Tensor, average: Any = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce; ``synchronize(handle)`` returns a new tensor."""
    what = label("allreduce_async", name)
    op = resolve_op(average, op, what)
    arr = to_numpy(check_tensor(tensor, what), what)
    c = comm(process_set)
    return Handle(c.allreduce_async(arr, op, name, prescale_factor, postscale_factor),
                  _new_tensor)


@refusals("allreduce")
def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor``."""
    what = label("allreduce_async_", name)
    op = resolve_op(average, op, what)
    arr, finish = _writable(tensor, what)
    c = comm(process_set)
    return Handle(c.allreduce_async_(arr, op, name, prescale_factor, postscale_factor), finish)


@refusals("allreduce", group="tensors")
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Any = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start one fused allreduce of ``tensors``; the result is a list of new tensors."""
    what = label("grouped_allreduce_async", name)
    op = resolve_op(average, op, what)
    arrs = [to_numpy(check_tensor(t, what), what) for t in tensors]
    return Handle(comm(process_set).grouped_allreduce_async(arrs, op, name, prescale_factor,
                                                 postscale_factor),
                  lambda out: [to_torch(a) for a in out])


@refusals("allreduce", group="tensors")
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Any = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place ``grouped_allreduce_async``; the result is the list ``tensors``."""
    what = label("grouped_allreduce_async_", name)
    op = resolve_op(average, op, what)
    views = [_writable(t, what) for t in tensors]
    inner = comm(process_set).grouped_allreduce_async_([a for a, _ in views], op, name,
                                                       prescale_factor, postscale_factor)
    return Handle(inner, lambda _: [finish(None) for _, finish in views])


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Any = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    """In-place ``grouped_allreduce``; returns ``tensors`` as a list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set=process_set))


def shared_zeros(shape: Union[int, Sequence[int]],
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled CPU tensor in memory every rank of a one-host job maps.

    Collective (every rank, same order, same shape and dtype); see
    ``ringreduce.shared_zeros``. Large allreduces of it, or of views of it at the
    same place on every rank, read the other ranks' data where it lies.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the tensor.
    dtype : torch.dtype
        Element type (float32).

    Returns
    -------
    torch.Tensor
        A contiguous CPU tensor; the memory lives as long as any view of it does.
    """
    dims = [int(shape)] if isinstance(shape, int) else [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise InvalidInputError(f"shared_zeros: negative dimension in shape {tuple(dims)}")
    nbytes = int(np.prod(dims, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = comm().shared_zeros(nbytes, np.uint8)  # collective, whatever the size
    if nbytes == 0:
        return torch.zeros(dims, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(dims)
