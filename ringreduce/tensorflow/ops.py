"""Collectives on TensorFlow tensors, with the signatures of ``horovod.tensorflow``.

Each call is one graph op (see ``_bridge``): it works eagerly, inside ``tf.function``
and in ``tf.compat.v1`` graphs. ``allreduce``, ``grouped_allreduce``, ``allgather``,
``broadcast``, ``reducescatter`` and ``alltoall`` are differentiable, with Horovod's
gradients (``ringreduce._grads``; allreduce's is the same allreduce of the gradient;
allgather's, this rank's rows of the average of the gradient; broadcast's, the average
on the root and zeros elsewhere; reducescatter's, the gradient gathered, times size for Sum).

Every collective takes Horovod's ``process_set`` (default: every rank): it then runs among
that set's members only, with ranks, sizes and roots counted within the set; a rank outside
the set that calls it gets an ``InvalidInputError``.

``device_dense`` / ``device_sparse`` and ``ignore_name_scope`` are Horovod's and are
accepted and ignored: tensors are handed to the engine where they lie (CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from ringreduce import Average, Communicator, Sum
from ringreduce._call_checks import check_scales
from ringreduce._grads import allgather_grad, alltoall_grad, broadcast_grad, reducescatter_grad
from ringreduce._horovod import resolve_op
from ringreduce._refusals import reports_refusals
from ringreduce.compression import Compressor
from ringreduce.exceptions import InvalidInputError, call_label
from ringreduce.process_sets import ProcessSet, global_process_set

from ._bridge import binder, call, check_tensor, current_int, graph_name
from .compression import Compression

__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "reducescatter"]

Getter = Callable[[], Communicator]
_MODULE = "ringreduce.tensorflow"

try:  # TensorFlow's own test of whether a GradientTape (or forward accumulator) records
    from tensorflow.python.eager.record import could_possibly_record as _recording
except ImportError:  # another layout: every eager call goes through tf.custom_gradient

    def _recording() -> bool:
        return True


def _refusals(kind: str, group: Optional[str] = None) -> Callable:
    """Calls refused here reach the other ranks, in eager mode (a refusal while a graph is
    traced refuses no collective yet: the graph's collectives run when it runs)."""
    return reports_refusals(kind, lambda ps: binder(ps, _MODULE)(), eager=tf.executing_eagerly,
                            group=group)


def _suffix(name: Optional[str], part: str) -> Optional[str]:
    return None if name is None else f"{name}.{part}"


def _with_shape(t: tf.Tensor, shape: Any) -> tf.Tensor:
    t.set_shape(shape)
    return t


# -------------------------------------------------------------------- allreduce
def _allreduce_dense(tensors: list, op: int, name: Optional[str], pre: float, post: float,
                     get: Getter) -> list:
    """One fused allreduce of ``tensors`` (a group when there are several); differentiable."""
    label = call_label("allreduce", name)

    def run(xs: list) -> list:
        if len(xs) == 1:
            return [get().allreduce(xs[0], op, name, pre, post)]
        return get().grouped_allreduce(xs, op, name, pre, post)

    if tf.executing_eagerly() and not _recording():
        # Nothing can differentiate this call (a metric, a loss to log): no
        # tf.custom_gradient around it, which costs ~0.1 ms a call.
        return [_with_shape(o, x.shape) for o, x in
                zip(call(run, list(tensors), [x.dtype for x in tensors], label), tensors)]

    @tf.custom_gradient
    def reduce(*xs: tf.Tensor) -> Any:
        outs = [_with_shape(o, x.shape) for o, x in
                zip(call(run, list(xs), [x.dtype for x in xs], label), xs)]

        def grad(*dys: tf.Tensor) -> list:
            if op not in (Sum, Average):
                raise InvalidInputError(f"{label}: only Sum and Average are differentiable")
            return _allreduce_dense([tf.convert_to_tensor(d) for d in dys], op,
                                    _suffix(name, "grad"), pre, post, get)

        return outs, grad

    return list(reduce(*tensors))


def _allreduce_sparse(t: tf.IndexedSlices, op: int, name: Optional[str],
                      get: Getter) -> tf.IndexedSlices:
    """IndexedSlices: every rank's (indices, values) gathered, values divided for Average."""
    if op not in (Sum, Average):
        raise InvalidInputError(f"{call_label('allreduce', name)}: tf.IndexedSlices support "
                                "Sum and Average only")
    values = allgather(t.values, name=_suffix(name, "values"), _get=get)
    indices = allgather(t.indices, name=_suffix(name, "indices"), _get=get)
    if op == Average:
        values = values / tf.cast(current_int(lambda: get().size(), "size"), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=t.dense_shape)


@_refusals("allreduce")
def allreduce(tensor: Any, average: Any = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over all ranks (Horovod's signature); differentiable.

    Parameters
    ----------
    tensor : tf.Tensor, tf.Variable or tf.IndexedSlices
        Same shape and dtype on every rank. IndexedSlices are allgathered
        (indices and values), their values divided by ``size()`` for Average.
    average : bool, optional
        Horovod's deprecated flag (True: Average, False: Sum).
    compression : Compressor
        ``Compression.none``, ``.fp16`` or ``.bf16``: the dtype on the wire.
    op : int, optional
        ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
    prescale_factor, postscale_factor : float
        Multiply the input before, and the result after, the reduction.
    name : str, optional
        Matches the tensor across ranks; unnamed calls are matched by the order they run
        in, except in ``tf.compat.v1`` graphs, where they are named when the graph is
        built (``_bridge.graph_name``).
    process_set : ProcessSet
        Reduce over this set's members only (they alone call it).

    Returns
    -------
    tf.Tensor or tf.IndexedSlices
        The reduced tensor, identical on every rank.
    """
    name = graph_name("allreduce", name)
    what = call_label("allreduce", name)
    code = resolve_op(average, op, what, _MODULE)
    get = binder(process_set, _MODULE)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, code, name, get)
    pre, post = check_scales(prescale_factor, postscale_factor, "allreduce", name)
    compressed, ctx = compression.compress(check_tensor(tensor, what))
    out = _allreduce_dense([check_tensor(compressed, what)], code, name, pre, post, get)[0]
    return compression.decompress(out, ctx)


@_refusals("allreduce", group="tensors")
def grouped_allreduce(tensors: Sequence[Any], average: Any = None, device_dense: str = "",
                      device_sparse: str = "", compression: type[Compressor] = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None) -> list:
    """Allreduce a list of tensors as one negotiated, fused unit; differentiable.

    Members are named ``name.0``, ``name.1``, ... IndexedSlices among them are
    allgathered separately (see ``allreduce``). Horovod's argument order (``name`` last).
    """
    name = graph_name("grouped_allreduce", name)
    what = call_label("grouped_allreduce", name)
    code = resolve_op(average, op, what, _MODULE)
    pre, post = check_scales(prescale_factor, postscale_factor, "grouped_allreduce", name)
    get = binder(process_set, _MODULE)
    tensors = list(tensors)
    out: list = [None] * len(tensors)
    dense, ctxs = [], []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _allreduce_sparse(t, code, _suffix(name, f"sparse{i}"), get)
            continue
        compressed, ctx = compression.compress(check_tensor(t, what))
        dense.append((i, check_tensor(compressed, what)))
        ctxs.append(ctx)
    if dense:
        reduced = _allreduce_dense([t for _, t in dense], code, name, pre, post, get) \
            if len(dense) > 1 else _allreduce_dense([dense[0][1]], code, _suffix(name, "0"),
                                                    pre, post, get)
        for (i, _), r, ctx in zip(dense, reduced, ctxs):
            out[i] = compression.decompress(r, ctx)
    return out


# ----------------------------------------------------------- data movement
@_refusals("allgather")
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set,
              _get: Optional[Getter] = None) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along axis 0 (its length may differ per rank);
    the other dimensions must agree. Differentiable."""
    name = graph_name("allgather", name)
    what = call_label("allgather", name)
    t = check_tensor(tensor, what)
    if t.shape.rank == 0:
        raise InvalidInputError(f"{what}: needs at least one dimension (got a scalar); "
                                "reshape it to [1]")
    get = _get or binder(process_set, _MODULE)

    @tf.custom_gradient
    def gather(x: tf.Tensor) -> Any:
        out = call(lambda xs: [get().allgather(xs[0], name)], [x], [x.dtype], what)[0]
        out = _with_shape(out, [None] + x.shape[1:].as_list() if x.shape.rank else None)
        rows = tf.shape(x, out_type=tf.int64)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            g = call(lambda a: [allgather_grad(get(), a[0], int(a[1]), name)],
                     [tf.convert_to_tensor(dy), rows], [dy.dtype], what + " (gradient)")[0]
            return _with_shape(g, x.shape)

        return out, grad

    return gather(t)


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather each of ``tensors``, submitted together (members named ``name.0``, ...;
    see ``allgather``); differentiable."""
    name = graph_name("grouped_allgather", name)
    what = call_label("grouped_allgather", name)
    ts = [check_tensor(t, what) for t in tensors]
    if not ts:
        return []
    get = binder(process_set, _MODULE)

    @tf.custom_gradient
    def gather(*xs: tf.Tensor) -> Any:
        outs = call(lambda a: get().grouped_allgather(a, name), list(xs),
                    [x.dtype for x in xs], what)
        outs = [_with_shape(o, [None] + x.shape[1:].as_list() if x.shape.rank else None)
                for o, x in zip(outs, xs)]
        rows = [tf.shape(x, out_type=tf.int64)[0] if x.shape.rank else tf.constant(1, tf.int64)
                for x in xs]

        def grad(*dys: tf.Tensor) -> list:
            def run(a: list) -> list:
                half = len(a) // 2
                return [allgather_grad(get(), g, int(r), _suffix(name, str(i)))
                        for i, (g, r) in enumerate(zip(a[:half], a[half:]))]

            gs = call(run, [tf.convert_to_tensor(d) for d in dys] + rows,
                      [d.dtype for d in dys], what + " (gradient)")
            return [_with_shape(g, x.shape) for g, x in zip(gs, xs)]

        return outs, grad

    return list(gather(*ts))


@_refusals("broadcast")
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank as a new tensor (with a process set:
    ``root_rank`` counts within the set); differentiable."""
    name = graph_name("broadcast", name)
    what = call_label("broadcast", name)
    t = check_tensor(tensor, what)
    get = binder(process_set, _MODULE)
    root = get()._check_root(root_rank, what)

    @tf.custom_gradient
    def bcast(x: tf.Tensor) -> Any:
        out = call(lambda xs: [get().broadcast(xs[0], root, name)], [x], [x.dtype], what)[0]

        def grad(dy: tf.Tensor) -> tf.Tensor:
            g = call(lambda a: [broadcast_grad(get(), a[0], root, name)],
                     [tf.convert_to_tensor(dy)], [dy.dtype], what + " (gradient)")[0]
            return _with_shape(g, x.shape)

        return _with_shape(out, x.shape), grad

    return bcast(t)


@_refusals("reducescatter")
def reducescatter(tensor: Any, device_dense: str = "",
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's share of axis 0 (lower ranks get
    the extra rows); differentiable for Sum and Average."""
    name = graph_name("reducescatter", name)
    what = call_label("reducescatter", name)
    code = resolve_op(None, op, what, _MODULE)
    pre, post = check_scales(prescale_factor, postscale_factor, "reducescatter", name)
    get = binder(process_set, _MODULE)
    compressed, ctx = compression.compress(check_tensor(tensor, what))

    @tf.custom_gradient
    def scatter(x: tf.Tensor) -> Any:
        out = call(lambda xs: [get().reducescatter(xs[0], code, name, pre, post)], [x],
                   [x.dtype], what)[0]
        out = _with_shape(out, [None] + x.shape[1:].as_list() if x.shape.rank else None)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            g = call(lambda a: [reducescatter_grad(get(), a[0], code, pre * post, name)],
                     [tf.convert_to_tensor(dy)], [dy.dtype], what + " (gradient)")[0]
            return _with_shape(g, x.shape)

        return out, grad

    return compression.decompress(scatter(check_tensor(compressed, what)), ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None) -> list:
    """Reducescatter each of ``tensors``, submitted together (members named ``name.0``, ...;
    see ``reducescatter``); differentiable for Sum and Average. Horovod's argument order."""
    name = graph_name("grouped_reducescatter", name)
    what = call_label("grouped_reducescatter", name)
    code = resolve_op(None, op, what, _MODULE)
    pre, post = check_scales(prescale_factor, postscale_factor, "grouped_reducescatter", name)
    get = binder(process_set, _MODULE)
    packed = [compression.compress(check_tensor(t, what)) for t in tensors]
    if not packed:
        return []

    @tf.custom_gradient
    def scatter(*xs: tf.Tensor) -> Any:
        outs = call(lambda a: get().grouped_reducescatter(a, code, name, pre, post), list(xs),
                    [x.dtype for x in xs], what)
        outs = [_with_shape(o, [None] + x.shape[1:].as_list() if x.shape.rank else None)
                for o, x in zip(outs, xs)]

        def grad(*dys: tf.Tensor) -> list:
            gs = call(lambda a: [reducescatter_grad(get(), g, code, pre * post,
                                                    _suffix(name, str(i)))
                                 for i, g in enumerate(a)],
                      [tf.convert_to_tensor(d) for d in dys], [d.dtype for d in dys],
                      what + " (gradient)")
            return [_with_shape(g, x.shape) for g, x in zip(gs, xs)]

        return outs, grad

    outs = scatter(*[check_tensor(c, what) for c, _ in packed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


@_refusals("alltoall")
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[r]`` rows of ``tensor`` to rank r; returns ``(received, received_splits)``
    as Horovod's TensorFlow API does. Without ``splits`` axis 0 is divided evenly.
    Differentiable (with respect to ``tensor``)."""
    name = graph_name("alltoall", name)
    what = call_label("alltoall", name)
    t = check_tensor(tensor, what)
    get = binder(process_set, _MODULE)
    if splits is None:
        splits_t = tf.zeros([0], tf.int64)
    else:
        splits_t = tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64)

    def run(xs: list) -> list:
        given = xs[1].size > 0
        out = get().alltoall(xs[0], [int(s) for s in xs[1]] if given else None, name)
        c = get()
        if given:
            return [out[0], out[1].astype(np.int64)]
        return [out, np.full(c.size(), xs[0].shape[0] // c.size(), np.int64)]

    @tf.custom_gradient
    def exchange(x: tf.Tensor) -> Any:
        out, received = call(run, [x, splits_t], [x.dtype, tf.int64], what)
        out = _with_shape(out, [None] + x.shape[1:].as_list() if x.shape.rank else None)

        def grad(dy: tf.Tensor, _unused: Any = None) -> tf.Tensor:
            g = call(lambda a: [alltoall_grad(get(), a[0], a[1], name)],
                     [tf.convert_to_tensor(dy), received], [dy.dtype], what + " (gradient)")[0]
            return _with_shape(g, x.shape)

        return (out, _with_shape(received, [None])), grad

    return exchange(t)
