"""Keras callbacks with the names of ``horovod.tensorflow.keras.callbacks``.

They run eagerly between steps, so they use the framework-neutral numpy collectives
(one copy of each value, once per epoch or once per training): they work with any
Keras backend. Every ringreduce callback also makes ``model.fit`` raise a failed
collective's own ``RingReduceError`` (``PeerLostError``, ``MismatchError``...) instead
of TensorFlow's or JAX's wrapper around it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import keras
import numpy as np

import ringreduce as _rr
from ringreduce._local_grads import LocalVariables
from ringreduce._state import agree, wait_all
from ringreduce.checkpoint import atomic_save_path

from .saving import model_suffix

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
           "ModelCheckpoint"]


def _translate_errors(model: Any) -> None:
    """Wrap the model's train/test functions so that a collective's error comes out as
    itself (TensorFlow and JAX backends wrap it in their own error; torch raises it
    directly)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from ringreduce.tensorflow._bridge import run_translated
    elif backend == "jax":
        from ringreduce.jax._bridge import run_translated
    else:
        return

    for attr in ("train_function", "test_function"):
        fn = getattr(model, attr, None)
        if fn is not None and not getattr(fn, "_rr_translated", False):
            def wrapped(*args: Any, _fn: Callable = fn, **kwargs: Any) -> Any:
                return run_translated(_fn, *args, **kwargs)

            wrapped._rr_translated = True  # type: ignore[attr-defined]
            setattr(model, attr, wrapped)


class _Callback(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self._rr_get = _rr._binder()

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Install the error translation on the model's compiled functions."""
        _translate_errors(self.model)

    def on_test_begin(self, logs: Optional[dict] = None) -> None:
        """Same for evaluation."""
        _translate_errors(self.model)


def broadcast_keras_variables(comm: Any, variables: list, root_rank: int, what: str) -> None:
    """Overwrite Keras variables with ``root_rank``'s values (eager; any backend)."""
    agree(comm, what, [(i, (tuple(v.shape), str(v.dtype))) for i, v in enumerate(variables)],
          " on the variables to broadcast")
    # Variable.numpy(): keras.ops.convert_to_numpy(variable) goes through the TF variable's
    # __array__, which numpy 2 warns about (no copy keyword)
    arrays = [np.array(v.numpy() if hasattr(v, "numpy") else keras.ops.convert_to_numpy(v),
                       order="C") for v in variables]
    handles = [comm.broadcast_async_(a, root_rank, f"{what}.{i}") for i, a in enumerate(arrays)]
    wait_all(handles)
    for v, a in zip(variables, arrays):
        v.assign(a)


class BroadcastGlobalVariablesCallback(_Callback):
    """Copy ``root_rank``'s model and optimizer variables to every rank, once.

    At the start of training when the model is built (its optimizer is built first if it
    is not yet), so every rank takes its first step from the same weights. A model that
    Keras builds only on its first batch (a ``Sequential`` without an ``Input``, a
    subclassed model: Horovod's examples) has no variables yet then: its broadcast
    happens at the end of the first batch instead, when model and optimizer exist, which
    is when Horovod's callback always broadcasts.

    Parameters
    ----------
    root_rank : int
        The rank whose values win (0 in Horovod's recipe).
    device : str
        Horovod's; ignored.
    local_variables : variable or list of them, optional
        Horovod 0.28's: variables left out (a model-parallel layer's, each rank its own;
        see ``register_local_var``). Every rank must leave out the same positions.
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._local = LocalVariables("BroadcastGlobalVariablesCallback")
        if local_variables is not None:
            many = isinstance(local_variables, (list, tuple, set))
            for v in local_variables if many else [local_variables]:
                self._local.register(v)
        self.broadcast_done = False
        self._done_on: Any = None  # the communicator of the broadcast

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        """Broadcast now if the model is built (every rank decides alike: same script).

        After an elastic reset (a new communicator) it broadcasts again: the workers that
        just joined built this callback afresh, and every rank must take part alike."""
        super().on_train_begin(logs)
        if self.broadcast_done and self._done_on is not self._rr_get():
            self.broadcast_done = False
        if not self.broadcast_done and self.model.built and self.model.variables:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        """Broadcast after the first batch if the model was not built at the start."""
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        opt = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables)
        if opt is not None:
            if not opt.built:
                opt.build(self.model.trainable_variables)
            variables += list(opt.variables)
        variables = [v for v in variables if not self._local.is_local(v)]
        c = self._rr_get()
        broadcast_keras_variables(c, variables, c._check_root(self.root_rank,
                                                              "BroadcastGlobalVariablesCallback"),
                                  "BroadcastGlobalVariablesCallback")
        self.broadcast_done, self._done_on = True, c


class MetricAverageCallback(_Callback):
    """At the end of every epoch, replace each metric in ``logs`` by its average over ranks
    (training and validation). Put it before callbacks that read the metrics
    (``ModelCheckpoint``, ``ReduceLROnPlateau``, ``EarlyStopping``)."""

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Average ``logs`` in place (one allreduce of all metrics, by sorted name)."""
        if not logs:
            return
        c = self._rr_get()
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        agree(c, "MetricAverageCallback", names, " on the metric names")
        values = np.array([float(logs[k]) for k in names], np.float64)
        averaged = c.allreduce(values, _rr.Average, name="MetricAverageCallback")
        for k, v in zip(names, averaged):
            logs[k] = float(v)


class LearningRateScheduleCallback(_Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to
    ``end_epoch`` (Horovod's callback).

    Parameters
    ----------
    initial_lr : float
        The base learning rate (already scaled by ``size()`` if you scale it).
    multiplier : float or callable
        ``multiplier(epoch)`` (epoch fractional unless ``staircase``), or a constant ``m``:
        exponential decay, ``m ** (epoch - start_epoch)`` (Horovod's convention).
    start_epoch, end_epoch : int
        The epochs ``[start, end)`` this schedule applies to (end None: to the end).
    staircase : bool
        Change the rate at epoch boundaries only; otherwise at every batch with a
        fractional epoch.
    momentum_correction : bool
        Horovod's; accepted and not applied: Keras 3 compiles an SGD optimizer's
        momentum into the train step as a constant, so it cannot be changed per batch.
    steps_per_epoch : int, optional
        Batches per epoch, for the fractional epoch; by default Keras's ``params["steps"]``.
    verbose : int
        With ``staircase``, print the rate at each epoch start (rank 0 only).

    The rate reached is logged as ``logs["lr"]`` at every epoch end, as Horovod does.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        # A constant is exponential decay from start_epoch on (Horovod's).
        self.multiplier = (multiplier if callable(multiplier)
                           else (lambda e: multiplier ** (e - start_epoch)))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.current_epoch = 0
        self._steps: Optional[int] = None  # batches per epoch, once known

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        lr = self.initial_lr * float(self.multiplier(epoch))
        self.model.optimizer.learning_rate = lr

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Set the rate for this epoch (staircase) or its first batch."""
        self.current_epoch = epoch
        if self._active(epoch):
            self._set(epoch)
            if self.verbose and self.staircase and self._rr_get().rank() == 0:
                lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
                print(f"\nEpoch {epoch + 1}: learning rate {lr:.6g}")

    def on_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        """Set the rate for a fractional epoch (``staircase=False``)."""
        if self.staircase:
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            return
        self._steps = steps
        epoch = self.current_epoch + batch / steps
        if self._active(epoch):
            self._set(epoch)

    on_train_batch_begin = on_batch_begin

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Log the rate (``logs["lr"]``), as Horovod's callback does."""
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` up to ``initial_lr`` over
    ``warmup_epochs``, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD";
    Horovod's callback). ``initial_lr`` is the rate for the full ``size()`` ranks."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Horovod's: one batch ahead, so that each epoch ends on a round number and
            # the last batch of warmup already runs at initial_lr. The size is read now:
            # an elastic job changes it (and workers that join build this callback then).
            size = self._rr_get().size()
            epoch += 1.0 / self._steps if self._steps else 0.0
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """At the end of warmup the rate is exactly ``initial_lr``."""
        if epoch + 1 == self.warmup_epochs:
            self.model.optimizer.learning_rate = self.initial_lr
        super().on_epoch_end(epoch, logs)
        if epoch + 1 == self.warmup_epochs:
            if self.verbose and self._rr_get().rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_lr:g}.")


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` that writes on ``root_rank`` only, atomically
    (temporary file beside the target, fsync, rename): a crash never leaves a torn file.

    Same arguments as Keras's, plus ``root_rank`` (default 0). Use it on every rank:
    the others skip saving.
    """

    def __init__(self, *args: Any, root_rank: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root_rank = root_rank
        self._rr_get = _rr._binder()

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        if self._rr_get().rank() != self.root_rank:
            return
        model = self.model
        real_save, real_weights = model.save, model.save_weights

        def save(filepath: str, *a: Any, **kw: Any) -> None:
            atomic_save_path(filepath, lambda tmp: real_save(tmp, *a, **kw),
                             model_suffix(filepath))

        def save_weights(filepath: str, *a: Any, **kw: Any) -> None:
            atomic_save_path(filepath, lambda tmp: real_weights(tmp, *a, **kw), ".weights.h5")

        # Instance attributes in front of the methods for the duration of the call
        # (object's own setattr: Keras layers track what is assigned to them).
        object.__setattr__(model, "save", save)
        object.__setattr__(model, "save_weights", save_weights)
        try:
            super()._save_model(epoch, batch, logs)
        finally:
            object.__delattr__(model, "save")
            object.__delattr__(model, "save_weights")



class BestModelCheckpoint(ModelCheckpoint):
    """Horovod's ``BestModelCheckpoint``: a ``ModelCheckpoint`` that keeps only the best
    model by ``monitor`` (``save_best_only=True``), written by ``root_rank``, atomically.

    ``filepath`` may stay None where ``KerasEstimator`` is given the callback as its
    ``checkpoint_callback``: the estimator points it at a file of its own and returns the
    model found best. Elsewhere give a path (``.keras``, or ``.weights.h5`` with
    ``save_weights_only=True``). Put ``MetricAverageCallback`` before it, so that the
    monitored value is the mean over the ranks.

    Raises
    ------
    InvalidInputError
        ``model.fit`` with no ``filepath`` set.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Union[str, int] = "epoch", filepath: Optional[str] = None,
                 save_weights_only: bool = False, root_rank: int = 0, **kwargs: Any) -> None:
        # Keras checks the suffix at construction: a placeholder until the path is known
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(placeholder if filepath is None else filepath, monitor=monitor,
                         verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
                         root_rank=root_rank, **kwargs)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: Any = None) -> None:
        if self.filepath is None:
            raise _rr.InvalidInputError(
                "BestModelCheckpoint: no filepath: give BestModelCheckpoint(filepath=...) "
                "(only KerasEstimator's checkpoint_callback chooses the file itself)")
        super().on_train_begin(logs)
