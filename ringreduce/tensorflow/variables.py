"""Start every rank from the same variables, and rank-0 checkpoints of TensorFlow state."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from ringreduce._state import agree, wait_all
from ringreduce.checkpoint import CheckpointError, load_on_root, read_pickled_dict, save_on_root
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet, global_process_set

from ._bridge import binder, call, check_tensor, comm, graph_name
from .gradients import instance_name

__all__ = ["broadcast_", "broadcast_global_variables", "broadcast_variables", "load_checkpoint",
           "save_checkpoint"]


def _signature(variables: list) -> list:
    return [(i, (tuple(v.shape), tf.as_dtype(v.dtype).name)) for i, v in enumerate(variables)]


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, inplace: bool = False
                        ) -> Any:
    """Overwrite ``variables`` on every rank with ``root_rank``'s values.

    Collective. Eagerly, it first checks that every rank passes as many variables
    with the same shapes and dtypes (raising the same error everywhere if not), then
    assigns; in a graph (``tf.function``, ``tf.compat.v1``) it returns the op that
    does the assignment. All values travel in one graph op, broadcast concurrently.

    Parameters
    ----------
    variables : iterable of tf.Variable (or keras.Variable)
        E.g. ``model.variables`` or ``model.variables + optimizer.variables``.
    root_rank : int
        The rank whose values win.
    process_set : ProcessSet
        Only among this set's members (``root_rank`` counts within the set).
    inplace : bool
        Horovod's; the variables are always assigned in place here.

    Returns
    -------
    tf.Operation or None
        The assignment op in graph mode; None when executed eagerly.
    """
    variables = list(variables)
    what = "broadcast_variables"
    get = binder(process_set, "ringreduce.tensorflow")
    root = get()._check_root(root_rank, what)
    if tf.executing_eagerly():
        agree(get(), what, _signature(variables), " on the variables to broadcast")
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    # In a tf.compat.v1 graph, named now (graph_name: its ops run in no fixed order).
    fixed = graph_name(what, None)

    def run(arrays: list) -> list:
        c = get()
        # Otherwise named when it runs, not when traced: a rank that retraces (a smaller
        # last batch) must not shift the names of every later broadcast.
        group = fixed or instance_name(what, c)
        outs = [c.broadcast_async(a, root, f"{group}.{i}") for i, a in enumerate(arrays)]
        return wait_all(outs)

    values = [check_tensor(tf.convert_to_tensor(v), f"{what} of {_label(v)}")
              for v in variables]
    new = call(run, values, [v.dtype for v in values], what)
    assigns = [v.assign(tf.reshape(x, v.shape)) for v, x in zip(variables, new)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_(variables: Any, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's in-place broadcast: assign ``root_rank``'s values to ``variables`` (one
    variable or a list) on every rank (see ``broadcast_variables``) and return them; in a
    graph, their values read after the assignment."""
    many = isinstance(variables, (list, tuple))
    variables = list(variables) if many else [variables]
    op = broadcast_variables(variables, root_rank, process_set)
    if op is None:
        return variables if many else variables[0]
    with tf.control_dependencies([op]):
        values = [tf.identity(v.read_value() if hasattr(v, "read_value") else v)
                  for v in variables]
    return values if many else values[0]


def _label(v: Any) -> str:
    return repr(getattr(v, "path", None) or getattr(v, "name", "a variable"))


def broadcast_global_variables(root_rank: int = 0) -> Any:
    """The op that broadcasts every global variable of the default graph from ``root_rank``
    (TF1 graphs; under eager execution use ``broadcast_variables(model.variables)``)."""
    if tf.executing_eagerly():
        raise InvalidInputError(
            "broadcast_global_variables() needs a tf.compat.v1 graph (eager execution has "
            "no global variables); call broadcast_variables(model.variables, root_rank) "
            "instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# --------------------------------------------------------------- checkpoints
def _variables_of(value: Any) -> Optional[list]:
    """The variables that stand for ``value`` in a checkpoint (None: a plain value)."""
    if isinstance(value, tf.Variable) or hasattr(value, "assign") and hasattr(value, "shape"):
        return [value]
    found = getattr(value, "variables", None)
    if callable(found):  # tf.compat.v1 optimizers: variables() is a method
        found = found()
    return list(found) if found is not None else None


def save_checkpoint(path: str, root_rank: int = 0, **state: Any) -> bool:
    """Write ``state`` to ``path`` on ``root_rank`` only, atomically; others return False.

    Not collective. Models, optimizers, ``tf.Module``s and variables are saved as the
    values of their ``variables`` (in their order, which Keras and ``tf.Module`` keep
    deterministic); other values as they are (pickled). The file is written to a
    temporary file beside ``path``, fsynced and renamed over it.

    Parameters
    ----------
    path : str
        Target file.
    root_rank : int
        The rank that writes.
    **state
        E.g. ``model=model, optimizer=opt, epoch=3``.
    """
    if comm().rank() != root_rank:
        return False
    payload = {}
    for key, value in state.items():
        variables = _variables_of(value)
        payload[key] = ("variables", [np.array(v.numpy()) for v in variables]) \
            if variables is not None else ("value", value)
    return save_on_root(comm(), path, root_rank, lambda f: pickle.dump(payload, f, protocol=4))


def load_checkpoint(path: str, root_rank: int = 0, missing_ok: bool = False,
                    **targets: Any) -> Optional[dict]:
    """Read ``path`` on ``root_rank``, broadcast it, and assign it to ``targets`` everywhere.

    Collective. Build models and optimizers first (for Keras:
    ``optimizer.build(model.trainable_variables)``) so that their variables exist.

    Returns
    -------
    dict or None
        Every saved key: a list of arrays for variables, the value otherwise;
        None if the file is missing and ``missing_ok``.

    Raises
    ------
    CheckpointError
        On every rank alike: missing or unreadable file, an absent key, or a target
        whose variables do not match the saved ones.
    """
    data = load_on_root(comm(), path, root_rank, read_pickled_dict, missing_ok)
    if data is None:
        return None
    absent = sorted(k for k in targets if k not in data)
    if absent:
        raise CheckpointError(f"load_checkpoint: {path!r} has no entries {absent} (it holds "
                              f"{sorted(data)})")
    for key, target in targets.items():
        kind, saved = data[key]
        variables = _variables_of(target)
        if kind != "variables" or variables is None:
            raise CheckpointError(f"load_checkpoint: {key!r} was saved as a plain value; "
                                  "read it from the returned dict instead")
        got = [(tuple(v.shape), tf.as_dtype(v.dtype).name) for v in variables]
        want = [(a.shape, tf.as_dtype(a.dtype).name) for a in saved]
        if got != want:
            raise CheckpointError(
                f"load_checkpoint: {key!r} has {len(got)} variables {got[:4]}... but "
                f"{path!r} holds {len(want)} {want[:4]}... (build the model and optimizer "
                "before loading, e.g. optimizer.build(model.trainable_variables))")
        for v, a in zip(variables, saved):
            v.assign(a)
    return {k: v for k, (_, v) in data.items()}
