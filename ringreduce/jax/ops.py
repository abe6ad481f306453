"""Collectives on JAX arrays, with the signatures of ``horovod.tensorflow``.

Each call works on concrete arrays (at once) and on traced ones, inside ``jax.jit`` and
under ``jax.grad`` (an ordered host callback; see ``_bridge``). ``allreduce``,
``grouped_allreduce``, ``allgather``, ``broadcast`` and ``reducescatter`` are
differentiable with Horovod's gradients (``ringreduce._grads``: allreduce's is the same
allreduce of the gradient; allgather's, this rank's rows of the average of the gradient;
broadcast's, the average on the root and zeros elsewhere; reducescatter's, the gradient
gathered, times size for Sum).

Typed PRNG keys (``jax.random.key``) are broadcast, gathered and sent by alltoall as their
key data and come back as keys of the same implementation; the reductions refuse them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ringreduce import Average, Sum
from ringreduce._call_checks import check_scales
from ringreduce._grads import allgather_grad, broadcast_grad, reducescatter_grad
from ringreduce._horovod import resolve_op
from ringreduce.compression import Compressor
from ringreduce.exceptions import InvalidInputError, call_label
from ringreduce.process_sets import ProcessSet, global_process_set

from ._bridge import Getter, binder, host_call, is_traced, placed_like, spec, traced_name
from ._keys import is_key, moved_as_data, refuse_keys, unwrap, wrap
from .compression import Compression

__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allreduce",
           "reducescatter"]

_MODULE = "ringreduce.jax"


def _part(name: Optional[str], part: str) -> Optional[str]:
    return None if name is None else f"{name}.{part}"


def _differentiable(primal: Callable[..., Any], grad: Callable[[Any], Any]) -> Callable:
    """``primal`` with the vector-Jacobian product ``grad`` (cotangents -> input cotangents);
    ``grad`` runs only when something differentiates the call."""
    f = jax.custom_vjp(primal)
    f.defvjp(lambda *xs: (primal(*xs), None), lambda _, g: grad(g))
    return f


def _check_arrays(xs: Sequence[Any], what: str) -> list:
    """JAX arrays (or tracers). A numpy input is converted too: inside ``jax.jit`` that
    stages it into the program, where left as it is it would run once, at trace time."""
    out = []
    for x in xs:
        if not isinstance(x, (jax.Array, jax.core.Tracer)):
            try:
                x = jnp.asarray(x)
            except TypeError as err:
                raise InvalidInputError(f"{what}: expected a JAX array, got "
                                        f"{type(x).__name__}") from err
        out.append(x)
    return out


# -------------------------------------------------------------------- allreduce
def _allreduce(xs: list, op: int, name: Optional[str], pre: float, post: float,
               get: Getter) -> list:
    """One allreduce of ``xs`` (one fused group when there are several); differentiable."""
    what = call_label("allreduce", name)
    traced = is_traced(*xs)
    run_name = traced_name("allreduce", name) if traced else name

    def host(*arrays: np.ndarray) -> list:
        if len(arrays) == 1:
            return [get().allreduce(arrays[0], op, run_name, pre, post)]
        return get().grouped_allreduce(list(arrays), op, run_name, pre, post)

    def primal(*ys: Any) -> list:
        return host_call(host, ys, [spec(y) for y in ys], what)

    if not traced:
        return primal(*xs)

    def grad(gs: list) -> tuple:
        if op not in (Sum, Average):
            raise InvalidInputError(f"{what}: only Sum and Average are differentiable")
        return tuple(_allreduce(list(gs), op, f"{run_name}.grad", pre, post, get))

    return _differentiable(primal, grad)(*xs)


def allreduce(tensor: Any, average: Any = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """Reduce ``tensor`` over all ranks (Horovod's signature); differentiable.

    Parameters
    ----------
    tensor : jax.Array
        Same shape and dtype on every rank.
    average : bool, optional
        Horovod's deprecated flag (``op`` is the current form).
    compression : Compressor
        ``Compression.fp16`` / ``.bf16`` cast float arrays for the wire and back.
    op : int, optional
        ``Sum``, ``Average`` (default), ``Min``, ``Max`` or ``Product``.
    prescale_factor, postscale_factor : float
        Multiply the input before, and the result after, the reduction.
    name : str, optional
        Matches the call across ranks (default: call order eagerly, trace order in jit).
    process_set : ProcessSet
        The ranks taking part.

    Returns
    -------
    jax.Array
        Bitwise the same on every rank.
    """
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, name, process_set)[0]


def grouped_allreduce(tensors: Sequence[Any], average: Any = None, device_dense: str = "",
                      device_sparse: str = "",
                      compression: type[Compressor] = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allreduce every array of ``tensors`` as one fused unit; returns a list (see
    ``allreduce``)."""
    what = call_label("grouped_allreduce" if len(tensors) != 1 else "allreduce", name)
    op = resolve_op(average, op, what, _MODULE)
    pre, post = check_scales(prescale_factor, postscale_factor, what)
    xs = _check_arrays(list(tensors), what)
    refuse_keys(xs, what)
    if not xs:
        return []
    packed = [compression.compress(x) for x in xs]
    outs = _allreduce([p for p, _ in packed], op, name, pre, post, binder(process_set, what))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


# ----------------------------------------------------------- data movement
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """Concatenate every rank's ``tensor`` along axis 0; differentiable.

    Eagerly the ranks' row counts may differ; inside ``jax.jit`` every rank must send the
    same number of rows (a traced result needs a static shape; checked when it runs).
    """
    what = call_label("allgather", name)
    x = _check_arrays([tensor], what)[0]
    if x.ndim == 0:
        raise InvalidInputError(f"{what}: needs at least one dimension, got a scalar")
    if is_key(x):  # typed PRNG keys travel as their key data (see _keys)
        return moved_as_data(x, lambda d: allgather(d, name, ignore_name_scope, process_set))
    get = binder(process_set, what)
    if not is_traced(x):
        return host_call(lambda a: get().allgather(a, name), [x], None, what)
    run_name = traced_name("allgather", name)
    rows = x.shape[0]

    def host(a: np.ndarray) -> np.ndarray:
        out = get().allgather(a, run_name)
        if out.shape[0] != rows * get().size():
            raise InvalidInputError(f"{what}: inside jax.jit every rank must send {rows} rows "
                                    f"(the traced shape); the ranks sent {out.shape[0]} in all")
        return out

    def primal(y: Any) -> Any:
        return host_call(host, [y], spec(y, (rows * get().size(),) + y.shape[1:]), what)

    def grad(g: Any) -> tuple:
        return (host_call(lambda a: allgather_grad(get(), a, rows, run_name), [g], spec(x),
                          what),)

    return _differentiable(primal, grad)(x)


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """``root_rank``'s ``tensor`` on every rank (a new array); differentiable."""
    what = call_label("broadcast", name)
    x = _check_arrays([tensor], what)[0]
    if is_key(x):  # typed PRNG keys travel as their key data (see _keys)
        return moved_as_data(x, lambda d: broadcast(d, root_rank, name, ignore_name_scope,
                                                    process_set))
    get = binder(process_set, what)
    traced = is_traced(x)
    run_name = traced_name("broadcast", name) if traced else name

    def primal(y: Any) -> Any:
        return host_call(lambda a: get().broadcast(a, root_rank, run_name), [y], spec(y), what)

    if not traced:
        return primal(x)

    def grad(g: Any) -> tuple:
        return (host_call(lambda a: broadcast_grad(get(), a, root_rank, run_name), [g],
                          spec(x), what),)

    return _differentiable(primal, grad)(x)


def reducescatter(tensor: Any, op: int = Average, name: Optional[str] = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> jax.Array:
    """Reduce ``tensor`` over all ranks and return this rank's share of axis 0 (lower ranks
    get the extra rows); differentiable for Sum and Average."""
    what = call_label("reducescatter", name)
    op = resolve_op(None, op, what, _MODULE)
    pre, post = check_scales(prescale_factor, postscale_factor, what)
    x = _check_arrays([tensor], what)[0]
    refuse_keys([x], what)
    if x.ndim == 0:
        raise InvalidInputError(f"{what}: needs at least one dimension, got a scalar")
    get = binder(process_set, what)
    c = get()
    rows = x.shape[0] // c.size() + (c.rank() < x.shape[0] % c.size())
    traced = is_traced(x)
    run_name = traced_name("reducescatter", name) if traced else name

    def primal(y: Any) -> Any:
        return host_call(lambda a: get().reducescatter(a, op, run_name, pre, post), [y],
                         spec(y, (rows,) + y.shape[1:]), what)

    if not traced:
        return primal(x)

    def grad(g: Any) -> tuple:
        return (host_call(lambda a: reducescatter_grad(get(), a, op, pre * post, run_name),
                          [g], spec(x), what),)

    return _differentiable(primal, grad)(x)


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows of ``tensor`` to every rank: without ``splits`` axis 0 divides evenly and
    the output is returned; with ``splits`` (eager only), ``(output, received_splits)``.
    Not differentiable."""
    what = call_label("alltoall", name)
    x = _check_arrays([tensor], what)[0]
    if is_key(x):  # typed PRNG keys travel as their key data (see _keys)
        data, impl = unwrap(x)
        out = alltoall(data, splits, name, ignore_name_scope, process_set)
        return (wrap(out[0], impl), out[1]) if splits is not None else wrap(out, impl)
    get = binder(process_set, what)
    if splits is not None:
        if is_traced(x):
            raise InvalidInputError(f"{what}: splits= gives a result shape known only at run "
                                    "time, which jax.jit cannot trace; call it eagerly")
        out, received = get().alltoall(np.asarray(x), [int(s) for s in np.asarray(splits)],
                                       name)
        return placed_like(out, x), placed_like(np.asarray(received, np.int32), x)
    run_name = traced_name("alltoall", name) if is_traced(x) else name
    return host_call(lambda a: get().alltoall(a, None, run_name), [x], spec(x), what)
