"""Elastic training for JAX: ``ringreduce.elastic`` with a state for pytrees.

::

    import ringreduce.jax as hvd

    hvd.init()
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch in batches:
                state.params, state.opt_state = step(state.params, state.opt_state, batch)
            state.commit()

    train(state)

Horovod has no JAX API; the names follow its ``TorchState`` (a keyword per piece of
state, kept as an attribute).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import jax
import numpy as np

from ringreduce.elastic import HostsUpdatedInterrupt, ObjectState, State, reset, run, run_fn

from .optimizer import broadcast_parameters

__all__ = ["HostsUpdatedInterrupt", "JaxState", "ObjectState", "State", "reset", "run",
           "run_fn"]

_SCALARS = (bool, int, float, complex, np.generic)


def _is_array_tree(value: Any) -> bool:
    """True for a pytree whose leaves are all arrays or numbers (broadcast as arrays)."""
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, (jax.Array, np.ndarray, *_SCALARS))
                                for leaf in leaves)


def _copy_leaf(leaf: Any) -> Any:
    # A copy even of immutable JAX arrays: a jitted step that donates its arguments
    # (donate_argnums) deletes the buffers the live state had, and the saved one with them.
    if isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf.copy()
    return copy.deepcopy(leaf)


class JaxState(State):
    """Pytrees (parameters, optax state) and plain values, kept as attributes.

    ``save`` copies every leaf (JAX arrays stay on their devices, with their sharding and
    weak types); ``sync`` sends rank 0's values to every rank: the keywords given as
    pytrees of arrays and numbers leaf by leaf with ``broadcast_parameters`` (checked for
    equal structure, shapes and dtypes), the others (judged from the values given here,
    e.g. ``losses=[]``) with ``broadcast_object``.

    Parameters
    ----------
    bcast_object, get_rank : callable, optional
        As for ``ringreduce.elastic.State``.
    **kwargs :
        The state, e.g. ``params=...``, ``opt_state=...``, ``epoch=0``.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank)
        self._names = list(kwargs)
        # Which values travel as arrays is fixed here, from what the script passed (the
        # same on every rank), never from live values: `losses=[]` on a fresh worker and
        # `[0.5]` on rank 0 would otherwise pick different collectives.
        self._arrays = [n for n, v in kwargs.items() if _is_array_tree(v)]
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    def save(self) -> None:
        self._saved = {n: jax.tree_util.tree_map(_copy_leaf, getattr(self, n))
                       for n in self._names}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, jax.tree_util.tree_map(_copy_leaf, value))

    def sync(self) -> None:
        for name in self._arrays:
            setattr(self, name, broadcast_parameters(getattr(self, name), 0))
        plain = {n: getattr(self, n) for n in self._names if n not in self._arrays}
        if len(self._arrays) < len(self._names):
            for name, value in self._bcast_object(plain).items():
                setattr(self, name, value)
        self.save()
