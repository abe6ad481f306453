"""How a JAX array reaches the engine, eagerly or from inside ``jax.jit``.

Eager (concrete arrays): the array is read where it lies (``np.asarray`` of a CPU array is
a view, no copy), the blocking collective runs at once, and its result becomes a JAX
array.

Traced (inside ``jax.jit``, ``jax.grad``, ``lax.scan``...): the collective becomes an
*ordered* ``io_callback``. Ordered effects run exactly once per execution, in program
order, never dropped as dead code nor repeated by rematerialisation, which a collective
needs: every rank must make the same calls. The callback blocks the thread that executes
the computation (on CPU, the caller's) while the engine runs, the GIL released; like any
blocking collective, jitted steps and eager calls must therefore come in the same order
on every rank. Results need static shapes, so a
traced allgather takes the same number of rows from every rank (``size() * rows``), and
a traced alltoall splits evenly; both are checked when the collective runs.

Errors: a collective failing inside compiled code reaches the caller as JAX's
``JaxRuntimeError`` with ringreduce's message in it; ``run_translated(step, ...)`` (and
ringreduce.keras's callbacks around ``model.fit``) re-raise the original
``PeerLostError``, ``MismatchError``... instead. Eager calls raise them directly.

Names: an unnamed eager call is matched across ranks by its order, as in the numpy API.
A traced call may run on another thread than the one making eager calls (an accelerator's
asynchronous dispatch), so order cannot match it: it is named after the line that made
it, ``jax.<function>@<file>:<line>.<kind>`` (the first caller outside ringreduce, JAX and
optax). Every rank runs the same program, so the names agree even when one rank retraces
and another does not (a last, smaller batch); a line traced several times in one program
(a Python loop) reuses its name, which is safe because ordered callbacks run one after
another, in the same order on every rank. ``name=`` overrides it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ringreduce import Communicator, _binder, _on, _wrapped_errors
from ringreduce.exceptions import InvalidInputError, RingReduceError
from ringreduce.process_sets import ProcessSet, global_process_set

__all__ = ["Getter", "binder", "host_call", "is_traced", "run_translated", "to_host",
           "traced_name", "translated"]

Getter = Callable[[], Communicator]


def is_traced(*xs: Any) -> bool:
    """Whether any of ``xs`` is a tracer (inside jit, grad, vmap, ...)."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


_LIBRARIES = ("ringreduce", "jax", "jaxlib", "optax", "keras", "flax", "equinox")


def traced_name(kind: str, name: Optional[str]) -> str:
    """The name of a collective traced now (see the module docstring)."""
    if name is not None:
        return str(name)
    frame = sys._getframe(1)
    while frame is not None and \
            str(frame.f_globals.get("__name__", "")).split(".")[0] in _LIBRARIES:
        frame = frame.f_back
    if frame is None:
        return f"jax.{kind}"
    code = frame.f_code
    return f"jax.{code.co_name}@{os.path.basename(code.co_filename)}:{frame.f_lineno}.{kind}"


def binder(process_set: ProcessSet = global_process_set, what: str = "") -> Getter:
    """A getter of the communicator current now, for ``process_set``: a traced call keeps it
    and runs on it later, whatever thread executes the computation."""
    get = _binder()
    if process_set is global_process_set or process_set is None or \
            process_set.process_set_id == 0:
        return get
    _on(process_set, what)  # refuses now, on a rank outside the set
    return lambda: get().process_sets.communicator(process_set, what)


def to_host(x: Any, what: str) -> np.ndarray:
    """A concrete JAX array (or anything array-like) as a numpy array, a view where it can."""
    if isinstance(x, jax.core.Tracer):
        raise InvalidInputError(f"{what}: a traced value reached an eager call")
    return np.asarray(x)


def placed_like(value: Any, like: Any) -> jax.Array:
    """``value`` (numpy) as a JAX array placed as the concrete array ``like``: a committed
    ``like`` keeps its sharding where the shapes agree (an allreduce's, a broadcast's
    result), else its device when it has one (an allgather's); an uncommitted one gives an
    uncommitted array on the default device, as ``jnp.asarray``. Where the shape and dtype
    agree, a weakly typed ``like`` gives a weakly typed result, so it promotes as before and
    does not make a jitted function retrace."""
    if not isinstance(like, jax.Array) or isinstance(like, jax.core.Tracer):
        return jnp.asarray(value)
    value = np.asarray(value)
    same = value.shape == tuple(like.shape) and value.dtype == like.dtype
    # jnp.asarray makes a strong type; zeros_like keeps the weak one, and an update keeps it
    out = jnp.zeros_like(like).at[...].set(value) if same and like.weak_type \
        else jnp.asarray(value)
    if not like.committed or not like.is_fully_addressable:
        return out
    if same:
        return jax.device_put(out, like.sharding)
    devices = like.sharding.device_set
    return jax.device_put(out, next(iter(devices))) if len(devices) == 1 else out


def _placed(result: Any, args: Sequence[Any]) -> Any:
    """An eager call's numpy result(s) as JAX arrays, each placed as its input (the first
    input where the call returns another count of arrays)."""
    if isinstance(result, (list, tuple)):
        placed = [placed_like(r, args[i] if len(result) == len(args) else args[0])
                  for i, r in enumerate(result)]
        return placed if isinstance(result, list) else tuple(placed)
    return placed_like(result, args[0])


def host_call(fn: Callable[..., Any], args: Sequence[Any], out: Any, what: str) -> Any:
    """``fn(*numpy_args)``: at once for concrete ``args`` (``out`` may then be None: an
    eager result's shape may be known only from the other ranks), as an ordered
    ``io_callback`` with result ``out`` (a pytree of ``jax.ShapeDtypeStruct``) when any is
    traced. Returns JAX arrays in the result's structure."""
    if not is_traced(*args):
        return _placed(fn(*[to_host(a, what) for a in args]), args)

    def run(*host_args: Any) -> Any:
        try:  # JAX may hand the callback its own (CPU) arrays: read them as numpy
            result = fn(*[np.asarray(a) for a in host_args])
        except RingReduceError as err:  # JAX re-raises it wrapped: see run_translated
            _wrapped_errors.remember(err)
            raise
        return jax.tree_util.tree_map(lambda o, r: np.asarray(r, o.dtype).reshape(o.shape),
                                      out, result)

    return io_callback(run, out, *args, ordered=True)


@contextmanager
def translated() -> Iterator[None]:
    """Re-raise a collective's RingReduceError itself instead of JAX's runtime error
    around it (a traced collective fails inside compiled code)."""
    try:
        yield
    except RingReduceError:
        raise
    except Exception as err:  # JaxRuntimeError (XlaRuntimeError in older releases)
        original = _wrapped_errors.find(str(err))
        if original is None:
            raise
        raise original.with_traceback(None) from err


def run_translated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` (e.g. a jitted training step), re-raising the RingReduceError of a
    collective that failed inside it (``PeerLostError``, ``MismatchError``...) as itself
    rather than as ``jax.errors.JaxRuntimeError``."""
    with translated():
        return fn(*args, **kwargs)


def spec(x: Any, shape: Optional[Sequence[int]] = None) -> jax.ShapeDtypeStruct:
    """The result description of a collective returning ``x``'s dtype in ``shape``."""
    return jax.ShapeDtypeStruct(tuple(x.shape if shape is None else shape), x.dtype)
