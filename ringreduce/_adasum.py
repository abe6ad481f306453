"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021), Horovod's ``op=Adasum``, for every framework layer.

The operator. For two gradients ``a`` and ``b`` of one tensor::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Orthogonal gradients add up; parallel ones average; anything between is combined in
proportion. A coefficient stays 1 when its vector's squared norm is below 1e-8 (as
Horovod does), so a zero gradient leaves the other unchanged.

The reduction over ranks is Horovod's recursive pairing: at level 1 rank 2i is combined
with rank 2i+1, at level 2 the result of ranks {4i, 4i+1} with that of {4i+2, 4i+3}, and
so on, distance doubling; a group without a partner at some level (rank counts that are
not powers of two, which Horovod refuses) goes up unchanged. Each tensor is combined on
its own (its own dot products), like Horovod's per-layer Adasum.

How it runs here. When the set's size is a power of two (as Horovod requires), the call
is one engine allreduce with op Adasum (a grouped call: one fused response, each tensor
combined on its own): Horovod's vector-halving distance-doubling exchange in C++
(``csrc/collectives/allreduce_adasum.cc``), which moves about what a ring allreduce moves;
dot products in double, elements in float (float16/bfloat16/float32) or double. There a
rank that has joined counts as a zero gradient, which Adasum passes through
(``adasum(a, 0) == a``): the pairing keeps its shape, the joined rank's leaf empty.

For other sizes (Horovod refuses them) every rank gathers every rank's gradient of each
tensor (one grouped allgather) and evaluates the same tree in float64, in the same order,
so every rank gets bitwise the same result; it is then cast back to the tensor's dtype.
That moves ``size`` times the data of a ring allreduce per rank. There ranks that have
joined contribute no rows, so the tree spans the ranks that contributed. Integer and
boolean tensors are refused on both paths (the operator needs real division).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np

from .exceptions import InvalidInputError, call_label

Adasum = 5  # after Sum, Average, Min, Max, Product (0-4); ReduceOp::kAdasum in the engine

_NORM_EPS = 1e-8

__all__ = ["Adasum", "adasum_combine", "adasum_tree", "check_floating", "gather_and_combine",
           "in_engine"]


def in_engine(size: int) -> bool:
    """Whether Adasum over ``size`` ranks runs in the engine (a power of two) rather than
    as a gather and a float64 tree in Python."""
    return size >= 1 and size & (size - 1) == 0


def adasum_combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``adasum(a, b)`` of two float64 vectors."""
    dot = float(np.dot(a, b))
    anorm, bnorm = float(np.dot(a, a)), float(np.dot(b, b))
    acoeff = 1.0 - dot / anorm * 0.5 if anorm >= _NORM_EPS else 1.0
    bcoeff = 1.0 - dot / bnorm * 0.5 if bnorm >= _NORM_EPS else 1.0
    return acoeff * a + bcoeff * b


def adasum_tree(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Combine the ranks' vectors (in rank order) by recursive pairing, distance doubling."""
    level = list(vectors)
    while len(level) > 1:
        pairs = [adasum_combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def check_floating(arrays: Sequence[np.ndarray], what: str) -> None:
    """InvalidInputError unless every array has a floating-point dtype."""
    for a in arrays:
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise InvalidInputError(f"{what}: Adasum needs floating-point tensors, got "
                                    f"{a.dtype}")


def adasum_part(name: Optional[str], i: int) -> Optional[str]:
    """Name of member ``i``'s allgather in an Adasum call, as ``grouped_allgather_async``
    names the members of ``<name>.adasum`` (unnamed stays unnamed)."""
    return None if name is None else f"{name}.adasum.{i}"


def gather_and_combine(comm: Any, arrays: Sequence[np.ndarray], name: Optional[str],
                       prescale: float, postscale: float,
                       what: str = "allreduce") -> tuple[Any, Callable[[list], list]]:
    """Start the grouped allgather of ``arrays``; return its handle and the function that
    turns the gathered rows into the Adasum results (new arrays, shapes and dtypes kept).
    """
    label = call_label(what, name)
    check_floating(arrays, label)
    rows = [np.ascontiguousarray(a).reshape(1, -1) for a in arrays]
    handle = comm.grouped_allgather_async(rows, None if name is None else f"{name}.adasum")

    def finish(gathered: list) -> list:
        out = []
        for g, a in zip(gathered, arrays):
            vectors = [row.astype(np.float64) * prescale for row in g]
            if not vectors:  # every rank joined: nothing was contributed
                vectors = [np.zeros(a.size, np.float64)]
            out.append((adasum_tree(vectors) * postscale).astype(a.dtype).reshape(a.shape))
        return out

    return handle, finish
