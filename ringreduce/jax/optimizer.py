"""Gradient averaging for optax, and starting every rank from the same state.

``DistributedOptimizer(tx)`` is an optax ``GradientTransformation`` that averages the
gradients over ranks (one fused allreduce of every leaf, inside ``jax.jit`` too) and then
applies ``tx``. ``broadcast_parameters`` / ``broadcast_optimizer_state`` return root's
pytree on every rank (JAX arrays are immutable, so they return new pytrees rather than
writing in place as torch does), after checking that every rank holds the same leaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ringreduce import Average
from ringreduce._horovod import check_passes, optimizer_scales
from ringreduce._state import agree, wait_all
from ringreduce.compression import Compressor
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._bridge import binder, is_traced, placed_like
from ._keys import is_key, unwrap, wrap
from .compression import Compression
from .ops import grouped_allreduce

__all__ = ["AccumulationState", "DistributedOptimizer", "allreduce_gradients",
           "broadcast_optimizer_state", "broadcast_parameters"]

_MODULE = "ringreduce.jax"


def allreduce_gradients(grads: Any, op: int = Average,
                        compression: type[Compressor] = Compression.none,
                        gradient_predivide_factor: float = 1.0, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Average (or sum) a pytree of gradients over ranks: one fused allreduce of all leaves.

    Works eagerly and inside ``jax.jit``. ``gradient_predivide_factor`` divides before the
    sum and the rest after it (Horovod's semantics).
    """
    what = "allreduce_gradients"
    pre, post = optimizer_scales(what, op, gradient_predivide_factor, module=_MODULE)
    leaves, tree = jax.tree_util.tree_flatten(grads)
    if not leaves:
        return grads
    outs = grouped_allreduce(leaves, compression=compression, op=op, prescale_factor=pre,
                             postscale_factor=post, name=name, process_set=process_set)
    return jax.tree_util.tree_unflatten(tree, outs)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None,  # noqa: N802
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Wrap an optax ``GradientTransformation`` so that it applies gradients averaged over
    all ranks.

    Parameters
    ----------
    optimizer : optax.GradientTransformation
        E.g. ``optax.adam(1e-3)``.
    name : str, optional
        Prefix of the gradients' allreduce (default: matched by trace order).
    compression : Compressor
        ``Compression.fp16`` / ``.bf16``: float gradients travel in 16 bits.
    backward_passes_per_step : int
        Gradients of this many ``update`` calls are accumulated locally (their mean, as
        optax's ``MultiSteps``) before one allreduce and one step of ``optimizer``; the
        calls in between return zero updates and communicate nothing.
    op : int
        ``Average`` (default) or ``Sum``.
    gradient_predivide_factor : float
        With Average: divide by this before the sum, by ``size / factor`` after it.
    process_set : ProcessSet
        The ranks that average.

    Returns
    -------
    optax.GradientTransformationExtraArgs
        ``init`` is ``optimizer``'s; ``update(grads, state, params)`` averages ``grads``,
        then calls ``optimizer.update``.
    """
    import optax

    what = "DistributedOptimizer"
    if not isinstance(optimizer, optax.GradientTransformation):
        raise InvalidInputError(f"{what}: expected an optax GradientTransformation (e.g. "
                                f"optax.adam(1e-3)), got {type(optimizer).__name__}")
    optimizer_scales(what, op, gradient_predivide_factor, module=_MODULE)
    passes = check_passes(what, backward_passes_per_step)
    inner = optax.with_extra_args_support(optimizer)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple:
        averaged = allreduce_gradients(updates, op, compression, gradient_predivide_factor,
                                       name, process_set)
        return inner.update(averaged, state, params, **extra)

    if passes == 1:
        return optax.GradientTransformationExtraArgs(inner.init, update)
    return _accumulating(inner, update, passes, optax)


class AccumulationState(NamedTuple):
    """``DistributedOptimizer``'s state with ``backward_passes_per_step > 1``."""

    count: Any  # update calls since the last step (int32 scalar)
    grads: Any  # their gradients' sum (a pytree like the parameters)
    inner: Any  # the wrapped optimizer's state


def _accumulating(inner: Any, update: Any, passes: int, optax: Any) -> Any:
    """Sum the gradients of ``passes`` update calls; on the last, average their mean over
    the ranks and step. optax's MultiSteps would run the wrapped update (and so the
    allreduce) on every call and keep its result only on the last; here the allreduce
    sits in the branch of a ``lax.cond`` that runs only then."""

    def init(params: Any) -> AccumulationState:
        return AccumulationState(jnp.zeros([], jnp.int32),
                                 jax.tree_util.tree_map(jnp.zeros_like, params),
                                 inner.init(params))

    def accumulate(grads: Any, state: AccumulationState, params: Any = None,
                   **extra: Any) -> tuple:
        total = jax.tree_util.tree_map(jnp.add, state.grads, grads)
        count = state.count + 1
        shapes = jax.eval_shape(lambda: update(grads, state.inner, params, **extra)[0])

        def step(_: Any) -> tuple:
            mean = jax.tree_util.tree_map(lambda g: g / passes, total)
            updates, inner_state = update(mean, state.inner, params, **extra)
            return updates, AccumulationState(jnp.zeros([], jnp.int32),
                                              jax.tree_util.tree_map(jnp.zeros_like, total),
                                              inner_state)

        def hold(_: Any) -> tuple:
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, AccumulationState(count, total, state.inner)

        return jax.lax.cond(count >= passes, step, hold, None)

    return optax.GradientTransformationExtraArgs(init, accumulate)


def _leaves(tree: Any, what: str) -> tuple[list, list, list, Any]:
    """(paths, leaves, the leaves as numpy arrays, treedef); a typed PRNG key becomes its key
    data; a leaf that is not an array is refused."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, leaves, arrays = [], [], []
    for path, leaf in pairs:
        key = jax.tree_util.keystr(path)
        if is_traced(leaf):
            raise InvalidInputError(f"{what}: {key} is traced; call it outside jax.jit")
        try:  # a writable copy: the broadcast lands in it
            arrays.append(np.array(unwrap(leaf)[0] if is_key(leaf) else leaf))
        except TypeError as err:
            raise InvalidInputError(f"{what}: {key} is a {type(leaf).__name__}, not an array; "
                                    "use broadcast_object() for other values") from err
        paths.append(key)
        leaves.append(leaf)
    return paths, leaves, arrays, treedef


def _broadcast_tree(tree: Any, root_rank: int, what: str, process_set: ProcessSet) -> Any:
    paths, leaves, arrays, treedef = _leaves(tree, what)
    c = binder(process_set, what)()
    # a key's dtype names its implementation (key<fry>): ranks must agree on it too
    agree(c, what, [(p, (a.shape, str(k.dtype) if is_key(k) else a.dtype.str))
                    for p, k, a in zip(paths, leaves, arrays)], " on the pytree to broadcast")
    wait_all([c.broadcast_async_(a, root_rank, f"{what}.{p}") for p, a in zip(paths, arrays)])
    return jax.tree_util.tree_unflatten(treedef, [_like(k, a) for k, a in zip(leaves, arrays)])


def _like(leaf: Any, value: np.ndarray) -> Any:
    """``value`` in ``leaf``'s kind: numpy stays numpy (a numpy scalar a numpy scalar), a
    Python scalar a Python scalar, a key a key of the same implementation, and a JAX array
    a JAX array of the same dtype, weak type and placement (device or sharding)."""
    if isinstance(leaf, np.ndarray):
        return value
    if isinstance(leaf, np.generic):
        return value[()]
    if isinstance(leaf, (bool, int, float, complex)):
        return type(leaf)(value.item())
    if is_key(leaf):
        data, impl = unwrap(leaf)
        return wrap(placed_like(value, data), impl)
    return placed_like(value, leaf)


def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s parameters (any pytree of arrays) on every rank.

    Collective and eager. Checks first that every rank passes the same paths, shapes and
    dtypes, and raises the same ``InvalidInputError`` everywhere if not. Each leaf comes
    back in its own kind: a JAX array with its dtype and ``weak_type``, a typed PRNG key
    (``jax.random.key``) as a key of the same implementation, numpy as numpy.
    """
    return _broadcast_tree(params, root_rank, "broadcast_parameters", process_set)


def broadcast_optimizer_state(opt_state: Any, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s optax state (a pytree) on every rank (see
    ``broadcast_parameters``)."""
    return _broadcast_tree(opt_state, root_rank, "broadcast_optimizer_state", process_set)
