"""Elastic training for Keras 3 (Horovod's ``hvd.elastic`` of ``horovod.tensorflow.keras``)::

    import ringreduce.keras as hvd   # or ringreduce.tensorflow.keras

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, initial_epoch=state.epoch, epochs=10, callbacks=callbacks)

    train(state)

The retry loop is ``ringreduce.elastic``'s (see its ``state`` module). ``KerasState``
keeps numpy copies of the model's and the optimizer's variables at each commit and
broadcasts rank 0's at each sync; it works with every Keras backend ringreduce supports.

Epochs: ``state.epoch`` counts the epochs completed. ``model.fit`` resumes from it when
given ``initial_epoch=state.epoch`` (or, as in Horovod's examples, ``epochs=total -
state.epoch``: the callback maps Keras's epoch index either way). An epoch interrupted
by a reset is trained again from its first batch (as with Horovod), from the weights of
the last commit; ``state.batch`` holds the batches of it done at that commit, for a data
pipeline that wants to skip them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import keras

from ringreduce import elastic as _elastic
from ringreduce.elastic import HostsUpdatedInterrupt, ObjectState, State, reset
from ringreduce.elastic.variables import VariablesState
from ringreduce.exceptions import InvalidInputError

from .callbacks import _Callback

__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "reset", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: Horovod's ``hvd.elastic.run`` (see ``ringreduce.elastic.run``); a failed
    collective wrapped by the backend (TensorFlow's ``OpError``, JAX's runtime error) is
    recognized as the ``PeerLostError`` it carries.

    Parameters
    ----------
    func : callable
        The training function; its first argument is the ``State``.

    Returns
    -------
    callable
        The wrapped function.
    """
    if keras.backend.backend() == "tensorflow":
        from ringreduce.tensorflow.elastic import run as tf_run

        return tf_run(func)
    return _elastic.run(func)


class KerasState(VariablesState):
    """State of a Keras model and its optimizer, plus plain values (Horovod's ``KerasState``).

    ``save`` keeps numpy copies of ``model.variables`` and the optimizer's variables;
    ``restore`` assigns them back; ``sync`` broadcasts rank 0's (``broadcast_variables``)
    and the keywords (``broadcast_object``). An optimizer that is not built yet (Keras
    builds it on the first step; a worker that just joined has taken none) is built from
    the model's trainable variables first, so that every rank has the same variables.
    Works on every Keras backend; on JAX a commit between batches of ``fit`` first puts
    the trainer's current values back into the variables (``model.jax_state_sync()``).

    Parameters
    ----------
    model : keras.Model
        A built model (``keras.Input`` given, or ``model.build(shape)`` called).
    optimizer : keras.optimizers.Optimizer, optional
        Default: ``model.optimizer`` (from ``compile``), looked up at each use.
    backend :
        Horovod's (a TF1 Keras backend); ignored.
    **kwargs :
        Plain values to keep and sync (``epoch=0, batch=0``), attributes of the state.
    """

    def __init__(self, model: Any, optimizer: Optional[Any] = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise InvalidInputError(f"{type(self).__name__}: the model must be built first "
                                    "(give it a keras.Input, or call model.build(shape))")
        self.model = model
        self._optimizer = optimizer
        super().__init__(**kwargs)

    @property
    def optimizer(self) -> Any:
        """The optimizer given, or the model's."""
        return self._optimizer if self._optimizer is not None else \
            getattr(self.model, "optimizer", None)

    def variables(self) -> list:
        # JAX backend: inside fit the trainer holds the values and the variables are empty
        # (purged) until the epoch ends; a commit between batches must put them back first
        # (the trainer's own hook for callbacks, after which it reads them back).
        sync_trainer = getattr(self.model, "jax_state_sync", None)
        if sync_trainer is not None:
            sync_trainer()
        variables = list(self.model.variables)
        opt = self.optimizer
        if opt is not None:
            if not opt.built:
                opt.build(self.model.trainable_variables)
            variables += list(opt.variables)
        return variables

    def broadcast_variables(self, variables: list) -> None:
        from . import broadcast_variables

        broadcast_variables(variables, root_rank=0)


class CommitStateCallback(_Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch.

    The commit itself is made at the start of the next batch, epoch or at the end of
    training: after every callback has seen the batch's end, so ``state.batch`` and
    ``state.epoch`` are committed up to date wherever this callback stands in the list.

    Parameters
    ----------
    state : ringreduce.elastic.State
        Usually a ``KerasState``.
    batches_per_commit : int
        Batches between commits (each one copies the variables).
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise InvalidInputError("CommitStateCallback: batches_per_commit must be an "
                                    f"int >= 1, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        self._pending = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Count from the start (every rank alike after a reset)."""
        super().on_train_begin(logs)
        self.batches_remaining = self.batches_per_commit
        self._pending = False

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Count the batch; a commit is due every ``batches_per_commit``."""
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.batches_remaining = self.batches_per_commit
            self._pending = True

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """A commit is due at every epoch end."""
        self._pending = True

    def _flush(self) -> None:
        if self._pending:
            self._pending = False
            self.state.commit()

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """Make a due commit."""
        self._flush()

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Make a due commit."""
        self._flush()

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        """Make a due commit (the last epoch's)."""
        self._flush()


class UpdateBatchStateCallback(_Callback):
    """Keep ``state.batch`` at the number of batches done in the current epoch (0 at each
    epoch end). Horovod kept the index of the last batch, one less."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Batches done in this epoch."""
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """A new epoch starts from its first batch."""
        self.state.batch = 0


class UpdateEpochStateCallback(_Callback):
    """Keep ``state.epoch`` at the number of epochs completed, across resets.

    Keras numbers the epochs of one ``fit`` from its ``initial_epoch``: with
    ``initial_epoch=state.epoch`` they are the global numbers, with ``epochs=total -
    state.epoch`` (Horovod's examples) they start at 0. The first epoch of each ``fit``
    is mapped to ``state.epoch`` as it was when training began, so both work.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch
        self._first: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Where this ``fit`` starts."""
        super().on_train_begin(logs)
        self.initial_epoch, self._first = self.state.epoch, None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Keras's index of this fit's first epoch."""
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """One more epoch completed."""
        first = epoch if self._first is None else self._first
        self.state.epoch = self.initial_epoch + (epoch - first) + 1
