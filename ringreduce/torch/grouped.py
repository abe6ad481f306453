"""The grouped collectives of ``horovod.torch`` on torch tensors, differentiable.

``grouped_allreduce`` is one fused allreduce of all its tensors (``ops``);
``grouped_allgather`` and ``grouped_reducescatter`` submit one collective per tensor
together, named ``<name>.<i>``. Their gradients are the grouped forms of the single
calls' gradients (Horovod's convention, ``ringreduce._grads``); a tensor whose output
got no gradient contributes zeros, so every rank runs the same collectives in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ringreduce import Average, Communicator, Sum
from ringreduce._call_checks import _part, check_scales
from ringreduce._grads import allgather_grad, reducescatter_grad
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._tensors import binder, check_tensor, comm, label, refusals, to_numpy, to_torch
from .compression import Compression, Compressor, device_compression
from .ops import Handle, resolve_op


def _wants_grad(tensors: Sequence[torch.Tensor], what: str) -> bool:
    if isinstance(tensors, torch.Tensor) or not tensors:
        raise InvalidInputError(f"{what}: expects a non-empty list of tensors")
    return torch.is_grad_enabled() and any(check_tensor(t, what).requires_grad for t in tensors)


def _grads(grads: Sequence[Optional[torch.Tensor]], like: Sequence[Any]) -> list:
    """The incoming gradients, contiguous, with zeros for outputs that got none."""
    return [torch.zeros(o.shape, dtype=o.dtype) if g is None else g.contiguous()
            for g, o in zip(grads, like)]


def _arrays(tensors: Sequence[torch.Tensor], what: str) -> list:
    return [to_numpy(check_tensor(t, what), what) for t in tensors]


# ------------------------------------------------------------ allreduce
def _grouped_allreduce_now(c: Communicator, tensors: Sequence[torch.Tensor], op: int,
                           name: Optional[str], compression: type[Compressor], pre: float,
                           post: float) -> list:
    what = label("grouped_allreduce", name)
    tensors = [check_tensor(t, what).detach() for t in tensors]
    wire = device_compression(compression, tensors[0]) if tensors else None
    if wire and all(t.is_cuda for t in tensors):  # cast by the GPU executor's kernels
        out = c.grouped_allreduce([to_numpy(t, what) for t in tensors], op, name, pre, post,
                                  compression=wire)
        return [to_torch(o) for o in out]
    packed = [compression.compress(t) for t in tensors]
    out = c.grouped_allreduce([to_numpy(b, what) for b, _ in packed], op, name, pre, post)
    return [compression.decompress(to_torch(o), ctx) for o, (_, ctx) in zip(out, packed)]


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple:
        ctx.args = args
        op, name, compression, pre, post, get_comm = args
        return tuple(_grouped_allreduce_now(get_comm(), tensors, op, name, compression, pre,
                                            post))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, name, compression, pre, post, get_comm = ctx.args
        if op not in (Sum, Average):
            raise InvalidInputError(f"{label('grouped_allreduce', name)}: op has no gradient; "
                                    "only Sum and Average are differentiable")
        out = _grouped_allreduce_now(get_comm(), _grads(grads, grads), op, _part(name, "grad"),
                                     compression, pre, post)
        return (None, *out)


@refusals("allreduce", group="tensors")
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Any = None,
                      name: Optional[str] = None,
                      compression: type[Compressor] = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allreduce all of ``tensors`` as one fused unit; returns a list of new tensors.

    The arguments are ``allreduce``'s, in Horovod's order (``compression`` before ``op``).
    Differentiable for Sum and Average: the backward pass is the same grouped allreduce
    of the gradients.
    """
    what = label("grouped_allreduce", name)
    op = resolve_op(average, op, what)
    pre, post = check_scales(prescale_factor, postscale_factor, "grouped_allreduce", name)
    if _wants_grad(tensors, what):
        args = (op, name, compression, pre, post, binder(process_set))
        return list(_GroupedAllreduceFn.apply(args, *tensors))
    return _grouped_allreduce_now(comm(process_set), tensors, op, name, compression, pre, post)


# ------------------------------------------------------------ allgather
class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple:
        name, get_comm = args
        ctx.args = (name, get_comm, [t.shape[0] if t.dim() else 0 for t in tensors])
        out = get_comm().grouped_allgather(_arrays(tensors, label("grouped_allgather", name)),
                                           name)
        return tuple(to_torch(o) for o in out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        name, get_comm, rows = ctx.args
        c = get_comm()
        out = [to_torch(allgather_grad(c, to_numpy(g, "grouped_allgather"), n,
                                       _part(name, f"{i}")))
               for i, (g, n) in enumerate(zip(_grads(grads, grads), rows))]
        return (None, *out)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather each of ``tensors`` (submitted together); differentiable.

    Parameters
    ----------
    tensors : list of torch.Tensor
        Each at least 1-d; per tensor, the dimensions after the first match across ranks.
    name : str, optional
        Base name; member ``i`` is ``<name>.<i>``.
    """
    what = label("grouped_allgather", name)
    if _wants_grad(tensors, what):
        return list(_GroupedAllgatherFn.apply((name, binder(process_set)), *tensors))
    return [to_torch(o) for o in comm(process_set).grouped_allgather(_arrays(tensors, what),
                                                                     name)]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start a grouped allgather; ``synchronize(handle)`` returns the list of results."""
    what = label("grouped_allgather_async", name)
    _wants_grad(tensors, what)
    return Handle(comm(process_set).grouped_allgather_async(_arrays(tensors, what), name),
                  lambda out: [to_torch(o) for o in out])


# -------------------------------------------------------- reducescatter
class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple, *tensors: torch.Tensor) -> tuple:
        op, name, pre, post, get_comm = args
        ctx.args = args
        out = get_comm().grouped_reducescatter(
            _arrays(tensors, label("grouped_reducescatter", name)), op, name, pre, post)
        return tuple(to_torch(o) for o in out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, name, pre, post, get_comm = ctx.args
        c = get_comm()
        out = [to_torch(reducescatter_grad(c, to_numpy(g, "grouped_reducescatter"), op,
                                           pre * post, _part(name, f"{i}")))
               for i, g in enumerate(_grads(grads, grads))]
        return (None, *out)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none,
                          op: int = Average, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list:
    """Reducescatter each of ``tensors`` (submitted together); differentiable for Sum and
    Average. The arguments are Horovod's, in its order; ``compression`` applies per tensor."""
    what = label("grouped_reducescatter", name)
    op = resolve_op(None, op, what)
    pre, post = check_scales(prescale_factor, postscale_factor, "grouped_reducescatter", name)
    packed = [compression.compress(t) for t in tensors] if tensors else []
    bufs = [b for b, _ in packed]
    if _wants_grad(bufs, what):
        out = list(_GroupedReducescatterFn.apply((op, name, pre, post, binder(process_set)),
                                                 *bufs))
    else:
        out = [to_torch(o) for o in comm(process_set).grouped_reducescatter(
            _arrays(bufs, what), op, name, pre, post)]
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: int = Average, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> Handle:
    """Start a grouped reducescatter; ``synchronize(handle)`` returns the list of results."""
    what = label("grouped_reducescatter_async", name)
    op = resolve_op(None, op, what)
    _wants_grad(tensors, what)
    return Handle(comm(process_set).grouped_reducescatter_async(_arrays(tensors, what), op, name,
                                                                prescale_factor,
                                                                postscale_factor),
                  lambda out: [to_torch(o) for o in out])
