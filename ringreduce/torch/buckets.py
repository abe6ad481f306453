"""Gradients as views of shared buckets: DistributedOptimizer's zero-copy path.

Layout. At wrapping time every registered dense CPU parameter gets a place in one
bucket per dtype, in reverse registration order (about the order backward produces
gradients), each place 64-byte aligned. A bucket is ``shared_zeros`` memory: every
rank of a host maps every bucket of the host's ranks, at the same offsets, so the
engine's in-place allreduce of gradients that are views of it reads the peers' gradients
where they lie (no copy into a fusion buffer, no shm-slot traffic; across hosts inside
each host, with a ring across). With ``RINGREDUCE_TRANSPORT=tcp`` the bucket is private
memory and the ring runs as before.

Protocol per parameter: a tensor hook runs when backward has computed the parameter's
gradient, just before autograd accumulates it. If ``p.grad`` is ``None`` (the state
after ``zero_grad()``), the hook marks the parameter for adoption and autograd keeps
its fresh gradient as ``p.grad`` (no copy); the optimizer's post-accumulate hook then
copies it into the parameter's view and makes the view ``p.grad`` (``adopt``): one
read and one write of the gradient, where zeroing the view and letting autograd add
into it cost a write, two reads and a write. A gradient that already is the view
(``zero_grad(set_to_none=False)``) is accumulated into in place; a tensor the user put
there is left alone, takes the ordinary path and is counted in ``fallbacks``. Sparse
gradients are never put in a bucket.

Invariants: a parameter that gets no gradient in a step keeps ``grad = None`` (as in
one process, so e.g. Adam leaves it alone); a view is only ever ``p.grad`` of its own
parameter; all views of a bucket share one version counter, so "changed in place while
being averaged" is judged per bucket (see ``changed``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch

_ALIGN = 64  # bytes


def enabled(flag: Optional[bool], compression_is_none: bool, params: list) -> bool:
    """Whether to lay gradients out in buckets: the ``gradient_buckets`` keyword, else
    ``RINGREDUCE_GRADIENT_BUCKETS`` (default on); never with compression (the wire
    tensor is a cast copy anyway) or for parameters off the CPU."""
    if flag is None:
        flag = os.environ.get("RINGREDUCE_GRADIENT_BUCKETS", "1").strip() not in ("0", "")
    return bool(flag) and compression_is_none and all(p.is_cpu for p in params)


class GradientBuckets:
    """The buckets of one DistributedOptimizer and the view of each parameter.

    Parameters
    ----------
    shared_zeros : callable
        ``(nbytes) -> numpy uint8 array``: the communicator's collective allocator.
    params : list of torch.Tensor
        Every rank passes the same parameters (shapes and dtypes), in the same order.
    """

    def __init__(self, shared_zeros: Callable[[int], np.ndarray], params: list) -> None:
        self.views: dict = {}  # parameter -> its view
        self.storages: set = set()  # data_ptr of each bucket's storage
        self.fallbacks = 0  # gradients averaged outside the buckets (the user moved them)
        self.marked: set = set()  # id() of parameters whose fresh gradient adopt() moves
        by_dtype: dict = {}
        for p in reversed(params):
            if p.layout == torch.strided:
                by_dtype.setdefault(p.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            self._build(shared_zeros, dtype, by_dtype[dtype])

    def _build(self, shared_zeros: Callable[[int], np.ndarray], dtype: torch.dtype,
               params: list) -> None:
        size = torch.empty((), dtype=dtype).element_size()
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() * size // _ALIGN) * _ALIGN
        flat = torch.from_numpy(shared_zeros(total)).view(dtype)
        self.storages.add(flat.untyped_storage().data_ptr())
        for p, off in zip(params, offsets):
            start = off // size
            self.views[p] = flat[start:start + p.numel()].view(p.shape)

    def pre_hook(self, p: torch.Tensor, owned: Callable[[], bool]) -> Callable:
        """The tensor hook that puts ``p``'s gradient in its view (see the module doc).

        It holds ``p`` weakly: ``p`` holds the hook in torch's C++ storage, where
        Python's garbage collector cannot see a cycle."""
        pref = weakref.ref(p)

        marked = self.marked

        def hook(grad: torch.Tensor) -> None:
            param = pref()
            if param is not None and param.grad is None and not grad.is_sparse and owned():
                marked.add(id(param))

        return hook

    def adopt(self, p: torch.Tensor) -> None:
        """After autograd accumulated: move a gradient marked by the pre-hook into the
        parameter's view and make the view ``p.grad``."""
        if id(p) not in self.marked:
            return
        self.marked.discard(id(p))
        grad, view = p.grad, self.views.get(p)
        if view is None or grad is None or grad.is_sparse or grad.shape != view.shape:
            return
        view.copy_(grad)
        p.grad = view

    def holds(self, grad: torch.Tensor) -> bool:
        return grad.untyped_storage().data_ptr() in self.storages

    def count_fallback(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Count a dense gradient of a bucketed parameter that is not its view."""
        view = self.views.get(p)
        if view is not None and not grad.is_sparse and grad.data_ptr() != view.data_ptr():
            self.fallbacks += 1

    def changed(self, slots: list) -> set:
        """The in-flight slots whose bucket was written after its last accumulation.

        Accumulations bump the shared version counter, and every submit records it, so
        the last submit of a step holds the count after the last accumulation; a later
        write (clipping between backward() and step()) moves it further."""
        last: dict = {}
        for s in slots:
            ptr = s.grad.untyped_storage().data_ptr()
            last[ptr] = max(last.get(ptr, -1), s.version)
        return {s for s in slots
                if s.grad._version != last[s.grad.untyped_storage().data_ptr()]}


def bucket_slots(buckets: Optional[GradientBuckets], inflight: list) -> tuple[list, list]:
    """Split in-flight dense slots into (in a bucket, elsewhere)."""
    if buckets is None:
        return [], inflight
    inside = [s for s in inflight if s.buf is not None and buckets.holds(s.grad)]
    ids = {id(s) for s in inside}
    return inside, [s for s in inflight if id(s) not in ids]


def describe(buckets: Optional[GradientBuckets]) -> dict[str, Any]:
    """Statistics for users and tests."""
    if buckets is None:
        return {"buckets": 0, "bucket_bytes": 0, "fallbacks": 0}
    nbytes = sum(v.numel() * v.element_size() for v in buckets.views.values())
    return {"buckets": len(buckets.storages), "bucket_bytes": nbytes,
            "fallbacks": buckets.fallbacks}
