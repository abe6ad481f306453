"""ringreduce for JAX and optax, with Horovod's names::

    import jax, optax
    import ringreduce.jax as hvd

    hvd.init()
    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    params = hvd.broadcast_parameters(init_params(jax.random.key(0)), root_rank=0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)   # averaged over ranks
        return optax.apply_updates(params, updates), opt_state

    hvd.save_checkpoint("ckpt.pkl", params=params, opt_state=opt_state)   # rank 0 only

Collectives take JAX arrays, eagerly and inside ``jax.jit`` (an ordered host callback
that runs exactly once per execution; see ``_bridge``). Data moves on the host, through
the same engine as every other layer; the C++ core is not compiled against JAX.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any, Optional

import jax
import numpy as np

from ringreduce import (
    Average,
    HorovodInternalError,
    InvalidInputError,
    Max,
    Min,
    MismatchError,
    NotInitializedError,
    PeerLostError,
    ProcessSet,
    Product,
    RingReduceError,
    RingReduceTimeoutError,
    Sum,
    _on,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ringreduce import _comm as _default_comm
from ringreduce.checkpoint import CheckpointError, load_on_root, read_pickled_dict, save_on_root
from ringreduce.compression import Compressor

from . import elastic
from ._bridge import run_translated
from .compression import Compression
from .ops import allgather, allreduce, alltoall, broadcast, grouped_allreduce, reducescatter
from .optimizer import (
    DistributedOptimizer,
    allreduce_gradients,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = [
    "Average", "CheckpointError", "Compression", "Compressor", "DistributedOptimizer",
    "HorovodInternalError", "InvalidInputError", "Max", "Min", "MismatchError",
    "NotInitializedError", "PeerLostError", "ProcessSet", "Product", "RingReduceError",
    "RingReduceTimeoutError", "Sum", "add_process_set", "allgather", "allgather_object",
    "allreduce", "allreduce_gradients", "alltoall", "barrier", "broadcast", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "broadcast_variables", "cross_rank",
    "cross_size", "elastic", "global_process_set", "grouped_allreduce", "init",
    "is_homogeneous", "is_initialized", "join",
    "load_checkpoint", "local_rank", "local_size", "rank", "reducescatter",
    "remove_process_set", "run_translated", "save_checkpoint", "shutdown", "size", "start_timeline",
    "stop_timeline",
]

broadcast_variables = broadcast_parameters  # horovod.tensorflow's name


def join() -> int:
    """Declare that this rank has no more data; returns the last rank to join (eager).

    Until every rank has joined, this rank takes part in the others' allreduces with
    zeros (Average divides by the ranks that contributed).
    """
    return _default_comm().join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank has called ``barrier()`` (eager)."""
    _on(process_set, "barrier").barrier()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (eager; JAX arrays included)."""
    return _on(process_set, "broadcast_object").broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Return every rank's picklable ``obj`` as a list in rank order (eager)."""
    return _on(process_set, "allgather_object").allgather_object(obj, name)


def save_checkpoint(path: str, root_rank: int = 0, **state: Any) -> bool:
    """Write ``state`` (pytrees: parameters, optax state, the epoch...) to ``path`` on
    ``root_rank`` only, atomically; other ranks return False at once.

    Not collective. JAX arrays are saved as numpy arrays (``jax.device_get``), and the
    paths of weakly typed ones under one more key, ``__ringreduce_weak_types__``; the file
    is written beside ``path``, fsynced and renamed over it, so a crash leaves the previous
    checkpoint or the new one.
    """
    c = _default_comm()
    if c.rank() != root_rank:
        return False
    if _WEAK_TYPES in state:
        raise InvalidInputError(f"save_checkpoint: {_WEAK_TYPES!r} is ringreduce's own key")
    payload = {key: jax.device_get(value) for key, value in state.items()}
    weak = [path for key, value in state.items() for path in _weak_paths(key, value)]
    if weak:
        payload[_WEAK_TYPES] = weak
    return save_on_root(c, path, root_rank, lambda f: pickle.dump(payload, f, protocol=4))


def load_checkpoint(path: str, root_rank: int = 0, missing_ok: bool = False) -> Optional[dict]:
    """Read ``path`` on ``root_rank`` and return its pytrees on every rank (collective).

    Parameters
    ----------
    path : str
        A file ``save_checkpoint`` wrote.
    root_rank : int
        The rank that reads it and sends it to the others.
    missing_ok : bool
        Return None on every rank if there is no file (otherwise a ``CheckpointError``).

    Returns
    -------
    dict or None
        The keywords given to ``save_checkpoint``. Saved arrays come back as JAX arrays of
        the dtype they were saved with, weakly typed where they were (a weak scalar such as
        a learning rate promotes as before and does not make a jitted step retrace), as
        ``jnp.asarray`` would make them otherwise: with
        ``jax_enable_x64`` on, float64 and int64 stay 64-bit; with it off (JAX's default)
        they become float32 and int32, as every JAX array is then, and a ``UserWarning``
        names those leaves (values outside the 32-bit range do not survive: enable x64
        before loading to keep them). An array of a dtype JAX has no type for (strings,
        objects) stays a numpy array. Other values come back as they were saved.

    Raises
    ------
    CheckpointError
        The same on every rank, whatever failed.
    """
    data = load_on_root(_default_comm(), path, root_rank, read_pickled_dict,
                        missing_ok)
    if data is None:
        return None
    narrowed: list[str] = []
    weak = set(data.pop(_WEAK_TYPES, ()))
    restored = {key: jax.tree_util.tree_map_with_path(
        lambda p, v, key=key: _restore_leaf(_leaf_path(key, p), v, narrowed, weak),
        value) for key, value in data.items()}
    if narrowed:
        warnings.warn(f"load_checkpoint: jax_enable_x64 is off, so {len(narrowed)} leaves saved "
                      f"in 64 bits come back in 32, as jnp.asarray makes them: "
                      f"{', '.join(narrowed[:8])}{' ...' if len(narrowed) > 8 else ''}. Enable "
                      "jax_enable_x64 before loading to keep them.", UserWarning, stacklevel=2)
    return restored


_WEAK_TYPES = "__ringreduce_weak_types__"


def _leaf_path(key: str, path: Any) -> str:
    return f"[{key!r}]{jax.tree_util.keystr(path)}"


def _weak_paths(key: str, value: Any) -> list[str]:
    """The paths (as ``load_checkpoint`` names them) of ``value``'s weakly typed arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    return [_leaf_path(key, p) for p, v in leaves
            if isinstance(v, jax.Array) and getattr(v, "weak_type", False)]


def _as_weak(out: jax.Array) -> jax.Array:
    """``out`` weakly typed, where its dtype is the weak one of its kind (JAX's default:
    a value saved weak in 64 bits and loaded with x64 off stays as narrowed, strong)."""
    zero = {"f": 0.0, "i": 0, "c": 0j, "b": False}.get(out.dtype.kind)
    if zero is None:
        return out
    base = jax.numpy.broadcast_to(jax.numpy.asarray(zero), out.shape)
    return base.at[...].set(out) if base.dtype == out.dtype else out


def _restore_leaf(path: str, value: Any, narrowed: list[str], weak: set) -> Any:
    """A saved leaf as a JAX array where JAX has its dtype (see ``load_checkpoint``),
    weakly typed if its path is in ``weak``; a leaf that ``jnp.asarray`` narrows is listed
    in ``narrowed`` as "path old -> new"."""
    if not isinstance(value, np.ndarray):
        return value
    try:
        out = jax.numpy.asarray(value)
    except TypeError:  # strings, objects, longdouble...: JAX has no such dtype
        return value
    if out.dtype != value.dtype:
        narrowed.append(f"{path} {value.dtype} -> {out.dtype}")
    return _as_weak(out) if path in weak else out
