"""Elastic training for TensorFlow 2 (Horovod's ``horovod.tensorflow.elastic``)::

    import ringreduce.tensorflow as hvd

    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for x, y in data:
                train_step(x, y)        # DistributedGradientTape or DistributedOptimizer
                state.commit()

    train(state)

The retry loop and its protocol are ``ringreduce.elastic``'s. A collective that fails
inside a ``tf.function`` reaches Python as a TensorFlow ``OpError`` carrying ringreduce's
message; ``run`` re-raises the ``PeerLostError`` behind it, which the loop recovers from
(``ringreduce.elastic.recoverable`` also finds it in the wrapper by itself).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from ringreduce import elastic as _elastic
from ringreduce.elastic import HostsUpdatedInterrupt, ObjectState, State, reset
from ringreduce.elastic.variables import VariablesState
from ringreduce.exceptions import InvalidInputError

# Keras 3 is TensorFlow 2's Keras: Horovod's TensorFlowKerasState is ringreduce.keras's
# KerasState (numpy copies of the model's and the optimizer's variables).
from ringreduce.keras.elastic import KerasState as TensorFlowKerasState

from ._bridge import run_translated
from .variables import broadcast_variables

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "reset", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` again from the last commit when a worker fails,
    from the current step when hosts are added or removed (Horovod's
    ``hvd.elastic.run``; see ``ringreduce.elastic.run``).

    Parameters
    ----------
    func : callable
        The training function; its first argument is the ``State``. Do not run
        collectives before calling it (``sync`` is the first one of every attempt).

    Returns
    -------
    callable
        The wrapped function.
    """
    @functools.wraps(func)
    def translating(state: Any, *args: Any, **kwargs: Any) -> Any:
        return run_translated(func, state, *args, **kwargs)

    return _elastic.run(translating)


class TensorFlowState(VariablesState):
    """State of a list of TensorFlow 2 variables, plus plain values (Horovod's
    ``TensorFlowState``).

    ``save`` keeps numpy copies of the variables, ``restore`` assigns them back, ``sync``
    broadcasts rank 0's (``broadcast_variables``) and the keywords. TensorFlow 2 (eager)
    only: a ``tf.compat.v1`` session's variables are refused.

    Parameters
    ----------
    variables : list of tf.Variable
        What to keep (a ``tf.Module``'s ``variables``, a model's and an optimizer's...).
    **kwargs :
        Plain values to keep and sync (``epoch=0``...), attributes of the state.
    """

    def __init__(self, variables: Optional[list] = None, session: Any = None,
                 **kwargs: Any) -> None:
        if session is not None or not tf.executing_eagerly():
            raise InvalidInputError(
                "TensorFlowState: tf.compat.v1 graphs and sessions are not supported by "
                "ringreduce's elastic training; use TensorFlow 2 (eager) variables")
        if variables is None:
            raise InvalidInputError("TensorFlowState: pass the variables to keep (TensorFlow 2 "
                                    "has no global variables)")
        self._variables = list(variables)
        super().__init__(**kwargs)

    def variables(self) -> list:
        return list(self._variables)

    def read(self, variable: Any) -> np.ndarray:
        return np.array(variable.numpy(), copy=True)

    def broadcast_variables(self, variables: list) -> None:
        broadcast_variables(variables, root_rank=0)
