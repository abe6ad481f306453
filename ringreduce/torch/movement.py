"""allgather, broadcast, reducescatter, alltoall on torch tensors (differentiable forms too).

Gradients follow Horovod's convention (``ringreduce._grads``; see the module docstring
of ``ops``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from ringreduce import Average, Communicator
from ringreduce._call_checks import check_scales
from ringreduce._grads import allgather_grad, alltoall_grad, broadcast_grad, reducescatter_grad
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._tensors import binder, check_tensor, comm, label, refusals, to_numpy, to_torch
from .compression import Compression, Compressor
from .ops import Handle, Splits, _writable, resolve_op, synchronize


def _wants_grad(t: torch.Tensor, what: str) -> bool:
    return torch.is_grad_enabled() and check_tensor(t, what).requires_grad


# ------------------------------------------------------------- allgather
class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                get_comm: Callable[[], Communicator]) -> torch.Tensor:
        ctx.args = (name, get_comm, tensor.shape[0] if tensor.dim() else 0)
        return to_torch(get_comm().allgather(to_numpy(tensor, label("allgather", name)), name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        name, get_comm, rows = ctx.args
        g = allgather_grad(get_comm(), to_numpy(grad.contiguous(), "allgather"), rows, name)
        return to_torch(g), None, None


@refusals("allgather")
def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (lengths may differ); differentiable.

    Parameters
    ----------
    tensor : torch.Tensor
        At least 1-d; the dimensions after the first must match across ranks.
    name : str, optional
        Identifies the tensor across ranks and in error messages.
    """
    if _wants_grad(tensor, label("allgather", name)):
        return _AllgatherFn.apply(tensor, name, binder(process_set))
    return to_torch(comm(process_set).allgather(to_numpy(tensor, label("allgather", name)), name))


@refusals("allgather")
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather; ``synchronize(handle)`` returns the concatenation."""
    what = label("allgather_async", name)
    arr = to_numpy(check_tensor(tensor, what), what)
    return Handle(comm(process_set).allgather_async(arr, name), to_torch)


# ------------------------------------------------------------- broadcast
class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                get_comm: Callable[[], Communicator]) -> torch.Tensor:
        ctx.args = (root_rank, name, get_comm)
        what = label("broadcast", name)
        return to_torch(get_comm().broadcast(to_numpy(tensor, what), root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        root_rank, name, get_comm = ctx.args
        g = broadcast_grad(get_comm(), to_numpy(grad.contiguous(), "broadcast"), root_rank, name)
        return to_torch(g), None, None, None


@refusals("broadcast")
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank as a new tensor; differentiable."""
    if _wants_grad(tensor, label("broadcast", name)):
        return _BroadcastFn.apply(tensor, root_rank, name, binder(process_set))
    what = label("broadcast", name)
    return to_torch(comm(process_set).broadcast(to_numpy(tensor, what), root_rank, name))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s in place (not tracked by autograd)."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set=process_set))


@refusals("broadcast")
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast into a new tensor."""
    what = label("broadcast_async", name)
    arr = to_numpy(check_tensor(tensor, what), what)
    return Handle(comm(process_set).broadcast_async(arr, root_rank, name), to_torch)


@refusals("broadcast")
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start an in-place broadcast into ``tensor``; ``synchronize`` returns ``tensor``."""
    arr, finish = _writable(tensor, label("broadcast_async_", name))
    return Handle(comm(process_set).broadcast_async_(arr, root_rank, name), finish)


# --------------------------------------------------------- reducescatter
class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, name: Optional[str], pre: float,
                post: float, get_comm: Callable[[], Communicator]) -> torch.Tensor:
        ctx.args = (op, name, pre * post, get_comm)
        what = label("reducescatter", name)
        return to_torch(get_comm().reducescatter(to_numpy(tensor, what), op, name, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, name, scale, get_comm = ctx.args
        g = reducescatter_grad(get_comm(), to_numpy(grad.contiguous(), "reducescatter"), op,
                               scale, name)
        return to_torch(g), None, None, None, None, None


@refusals("reducescatter")
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's share of dim 0; differentiable.

    Dim 0 is split as evenly as possible; lower ranks get the extra rows. The arguments
    are Horovod's, in its order.
    """
    what = label("reducescatter", name)
    op = resolve_op(None, op, what)
    buf, cctx = compression.compress(check_tensor(tensor, what))
    if _wants_grad(buf, what):
        out = _ReducescatterFn.apply(buf, op, name,
                                     *check_scales(prescale_factor, postscale_factor,
                                                   "reducescatter", name), binder(process_set))
    else:
        out = to_torch(comm(process_set).reducescatter(to_numpy(buf, what), op, name,
                                                       prescale_factor, postscale_factor))
    return compression.decompress(out, cctx)


@refusals("reducescatter")
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reducescatter; ``synchronize(handle)`` returns this rank's share."""
    what = label("reducescatter_async", name)
    op = resolve_op(None, op, what)
    arr = to_numpy(check_tensor(tensor, what), what)
    return Handle(comm(process_set).reducescatter_async(arr, op, name, prescale_factor,
                                                        postscale_factor), to_torch)


# --------------------------------------------------------------- alltoall
def _splits_list(splits: Splits) -> Optional[list[int]]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def _alltoall_result(given: bool) -> Callable[[Any], Any]:
    def finish(out: Any) -> Any:
        if given:
            return to_torch(out[0]), torch.from_numpy(np.asarray(out[1], np.int64))
        return to_torch(out)

    return finish


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Optional[list], name: Optional[str],
                get_comm: Callable[[], Communicator]) -> tuple:
        c = get_comm()
        if splits is None:  # even split: every rank sends and receives the same row count
            rows = tensor.shape[0] if tensor.dim() else 0
            if rows % c.size():
                raise InvalidInputError(f"{label('alltoall', name)}: dim 0 ({rows}) does not "
                                        f"divide by size {c.size()}; pass splits=")
            splits = [rows // c.size()] * c.size()
        out, received = c.alltoall(to_numpy(tensor, label("alltoall", name)), splits, name)
        ctx.args = (name, get_comm, [int(r) for r in received])
        received = torch.from_numpy(np.asarray(received, np.int64))
        ctx.mark_non_differentiable(received)
        return to_torch(out), received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> tuple:
        name, get_comm, received = ctx.args
        g = alltoall_grad(get_comm(), to_numpy(grad.contiguous(), "alltoall"), received, name)
        return to_torch(g), None, None, None


@refusals("alltoall")
def alltoall(tensor: torch.Tensor, splits: Splits = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank r; differentiable.

    Without ``splits`` dim 0 must divide by ``size()`` and the received tensor is
    returned; with ``splits`` a tuple ``(output, received_splits)``.
    """
    what = label("alltoall", name)
    given = splits is not None
    if _wants_grad(tensor, what):
        out, received = _AlltoallFn.apply(tensor, _splits_list(splits), name, binder(process_set))
        return (out, received) if given else out
    return _alltoall_result(given)(comm(process_set).alltoall(to_numpy(tensor, what),
                                                   _splits_list(splits), name))


@refusals("alltoall")
def alltoall_async(tensor: torch.Tensor, splits: Splits = None,
                   name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; ``synchronize(handle)`` returns what ``alltoall`` would."""
    what = label("alltoall_async", name)
    return Handle(comm(process_set).alltoall_async(to_numpy(check_tensor(tensor, what), what),
                                        _splits_list(splits), name),
                  _alltoall_result(splits is not None))
