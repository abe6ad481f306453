"""Typed PRNG keys (``jax.random.key(0)``, dtype ``key<fry>``) in collectives.

A key array cannot become a numpy array, so it travels as its key data
(``jax.random.key_data``: uint32, the key's shape plus the implementation's trailing
dimensions) and is rebuilt with the same implementation (``jax.random.wrap_key_data``).
That is exact for the operations that only move data (broadcast, allgather, alltoall);
reducing keys (a sum, an average) has no meaning, so reductions refuse them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from ringreduce.exceptions import InvalidInputError

__all__ = ["is_key", "moved_as_data", "refuse_keys", "unwrap", "wrap"]


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (concrete or traced)."""
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:  # a dtype numpy cannot interpret as one (an object's own attribute)
        return False


def unwrap(key: Any) -> tuple[Any, Any]:
    """``(key data, implementation)`` of a key array."""
    return jax.random.key_data(key), jax.random.key_impl(key)


def wrap(data: Any, impl: Any) -> Any:
    """The key array of ``data`` (as ``unwrap`` gave it) with implementation ``impl``."""
    return jax.random.wrap_key_data(data, impl=impl)


def moved_as_data(x: Any, call: Callable[[Any], Any]) -> Any:
    """``call(x)``, and for a key array ``x`` the keys of ``call`` on its key data: the data
    moves whole, keys keep their implementation."""
    if not is_key(x):
        return call(x)
    data, impl = unwrap(x)
    return wrap(call(data), impl)


def refuse_keys(xs: Any, what: str) -> None:
    """Raise InvalidInputError if any of ``xs`` is a key array: a reduction of keys (sum,
    average...) is no key; refusing at once, on the rank that passed it, beats a result
    that looks random and is not."""
    for x in xs:
        if is_key(x):
            raise InvalidInputError(
                f"{what}: cannot reduce a typed PRNG key array ({x.dtype}); keys are moved, "
                "not averaged. Broadcast it (broadcast / broadcast_parameters) so every rank "
                "draws the same numbers, or fold the rank in (jax.random.fold_in) for "
                "different ones; reduce jax.random.key_data(key) if you really mean it")
