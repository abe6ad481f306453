"""The gradients of the data-movement collectives, on arrays, for every framework layer.

Convention: Horovod's (``horovod.torch`` and ``horovod.tensorflow`` alike), so a ported
script computes the same numbers. allgather and broadcast average the incoming gradient
over the ranks; reducescatter gathers it back and multiplies it by ``size`` for Sum (and
by nothing for Average); alltoall sends it back. This is not the gradient of any one
objective (allgather's is that of the mean of the ranks' losses, reducescatter's is
``size`` times that of their sum); see the README's "Differences from Horovod" for why
ringreduce keeps it anyway. Each function runs on the backward pass of every rank, in the
same order, so its own collectives match across ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._call_checks import _OP_NAMES, Average, Sum, _part
from .exceptions import InvalidInputError, call_label

__all__ = ["allgather_grad", "alltoall_grad", "broadcast_grad", "reducescatter_grad"]


def allgather_grad(comm: Any, grad: np.ndarray, rows: int, name: Optional[str]) -> np.ndarray:
    """This rank's rows of the average over ranks of the gathered output's gradient."""
    counts = comm.allgather(np.array([rows], np.int64), _part(name, "grad.rows"))
    offset = int(counts[:comm.rank()].sum())
    total = comm.allreduce(np.ascontiguousarray(grad), Average, _part(name, "grad"))
    return total[offset:offset + rows]


def broadcast_grad(comm: Any, grad: np.ndarray, root_rank: int,
                   name: Optional[str]) -> np.ndarray:
    """The average over ranks of the gradient on the root, zeros elsewhere."""
    total = comm.allreduce(np.ascontiguousarray(grad), Average, _part(name, "grad"))
    return total if comm.rank() == root_rank else np.zeros_like(total)


def reducescatter_grad(comm: Any, grad: np.ndarray, op: int, scale: float,
                       name: Optional[str]) -> np.ndarray:
    """Every rank's share gathered back, times the scale factors (and ``size`` for Sum).

    Horovod leaves the prescale/postscale factors out of this gradient; ringreduce applies
    them (the same result whenever both are 1.0).
    """
    if op not in (Sum, Average):
        raise InvalidInputError(f"{call_label('reducescatter', name)}: op {_OP_NAMES[op]} has "
                                "no gradient; only Sum and Average are differentiable")
    g = comm.allgather(np.ascontiguousarray(grad), _part(name, "grad"))
    scale = scale * comm.size() if op == Sum else scale
    return g * np.asarray(scale, g.dtype) if scale != 1.0 else g


def alltoall_grad(comm: Any, grad: np.ndarray, received: Any, name: Optional[str]) -> np.ndarray:
    """The rows sent back to the ranks they came from."""
    out, _ = comm.alltoall(np.ascontiguousarray(grad), [int(s) for s in received],
                           _part(name, "grad"))
    return out
