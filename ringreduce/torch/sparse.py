"""Reducing sparse COO gradients (e.g. ``nn.Embedding(sparse=True)``) by allgather.

Every rank contributes its (indices, values); after the allgather each rank
builds the sum as one sparse tensor (duplicate indices add up when coalesced)
and scales it like the dense allreduce would.

Average divides by the ranks that contributed, like the dense allreduce: a rank
that has called ``join()`` contributes no rows to allgathers, so every
contributing rank appends one marker row (all indices ``-1``) to its indices,
and the number of marker rows received is the divisor.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ringreduce import Average, Communicator, Sum
from ringreduce._call_checks import _part
from ringreduce.exceptions import InvalidInputError

from ._tensors import comm, to_numpy, to_torch
from .ops import Handle, resolve_op


class SparseAllreduce:
    """An allreduce of a sparse tensor in flight, as two allgathers; ``wait()`` returns it.

    Parameters
    ----------
    comm : ringreduce.Communicator
        Where to reduce.
    grad : torch.Tensor
        Sparse COO tensor with the same dense shape on every rank.
    name : str or None
        Base name; the allgathers are ``<name>.indices`` and ``<name>.values`` (unnamed:
        matched by the order of the calls).
    op : int
        ``Sum`` or ``Average``.
    prescale, postscale : float
        Applied to the values before and after the reduction.
    """

    def __init__(self, comm: Communicator, grad: torch.Tensor, name: Optional[str], op: int,
                 prescale: float = 1.0, postscale: float = 1.0) -> None:
        if op not in (Sum, Average):
            raise InvalidInputError(f"sparse allreduce {name!r}: only Sum and Average are "
                                    "supported (in DistributedOptimizer: pass "
                                    "sparse_as_dense=True)")
        g = grad.coalesce()
        values = g.values() * prescale if prescale != 1.0 else g.values()
        marker = torch.full((1, g.sparse_dim()), -1, dtype=torch.int64)
        self._indices = torch.cat([g.indices().t().to(torch.int64), marker]).contiguous()
        self._values = values.contiguous()
        self._shape, self._average = g.shape, op == Average
        self._scale = postscale
        self._handles = [
            comm.allgather_async(to_numpy(self._indices, f"sparse gradient {name!r}"),
                                 _part(name, "indices")),
            comm.allgather_async(to_numpy(self._values, f"sparse gradient {name!r}"),
                                 _part(name, "values")),
        ]

    def done(self) -> bool:
        """True once both allgathers have completed."""
        return all(h.done() for h in self._handles)

    def wait(self) -> Any:
        """Wait for the allgathers and return the reduced sparse tensor (coalesced)."""
        results, errors = [], []
        for h in self._handles:  # wait for both, even if one fails
            try:
                results.append(h.wait())
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]
        indices, values = (to_torch(a) for a in results)
        real = indices[:, 0] >= 0
        scale = self._scale / (int((~real).sum()) if self._average else 1)
        indices = indices[real]
        if scale != 1.0:
            values = values * scale
        return torch.sparse_coo_tensor(indices.t(), values, self._shape,
                                       check_invariants=False).coalesce()


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None,
                           op: int = Average) -> Handle:
    """Start an allreduce of a sparse COO tensor (Horovod's name); ``synchronize(handle)``
    returns the reduced sparse tensor, coalesced.

    It runs as two allgathers (indices and values); duplicate indices add up.
    """
    what = f"sparse_allreduce_async {name!r}" if name else "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise InvalidInputError(f"{what}: expects a sparse COO torch.Tensor; use allreduce_async "
                                "for dense tensors")
    return Handle(SparseAllreduce(comm(), tensor, name, resolve_op(None, op, what)),
                  lambda result: result)
