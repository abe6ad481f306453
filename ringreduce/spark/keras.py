"""``KerasEstimator`` and ``KerasModel``: Horovod's ``horovod.spark.keras``, a Keras 3 model
trained on a Spark DataFrame by ``num_proc`` ranks in Spark tasks and returned as a Spark
ML ``Model``::

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.keras import KerasEstimator

    est = KerasEstimator(num_proc=2, store=Store.create("/shared/runs"), model=model,
                         optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                         feature_cols=["features"], label_cols=["y"], batch_size=32,
                         epochs=5, validation=0.1)
    fitted = est.fit(df)                  # a KerasModel
    fitted.transform(df).select("y__output")

What a fit does, step by step, is in ``ringreduce/spark/_estimator.py``; the loop each rank
runs is ``_train`` below: the model travels as the bytes of a ``.keras`` file and the
optimizer as its Keras config; each rank rebuilds them, wraps the optimizer in
``ringreduce.keras.DistributedOptimizer``, compiles with ``loss``, ``loss_weights`` and
``metrics``, broadcasts the model's and the optimizer's variables from rank 0 (after a
resume, rank 0's checkpoint) and calls ``model.fit`` once over the remaining epochs, with
``MetricAverageCallback`` (the ranks take the same number of equal batches, so the average
of their means is the mean over all rows), the exact validation of every epoch, the run's
checkpoint, then the user's ``callbacks``. Tested on the TensorFlow backend (Horovod's).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any, Callable, Optional

import keras
import numpy as np

from ._estimator import (
    COMMON_PARAMS,
    EstimatorBase,
    ModelBase,
    RankData,
    TrainSpec,
    end_epoch,
    load_resume,
    mean_across,
    mismatched_checkpoint,
    with_params,
)

__all__ = ["KerasEstimator", "KerasModel"]


@with_params({**COMMON_PARAMS, "custom_objects": {}, "checkpoint_callback": None,
              "backward_passes_per_step": 1})
class KerasEstimator(EstimatorBase):
    """Horovod's ``KerasEstimator``: ``fit(df)`` trains ``model`` with ``optimizer`` on
    ``num_proc`` ranks and returns a ``KerasModel``.

    Parameters (keywords, or Horovod's ``setX`` methods)
    ----------
    model : keras.Model
        A built model (it is saved as a ``.keras`` file), one input per feature column
        (floating columns as float32; reshaped to the input's shape when it differs).
    optimizer : keras.optimizers.Optimizer
        Each rank trains with a fresh optimizer of the same config (its state is not sent).
    loss : str, keras.losses.Loss, callable, or a list of them (one per label column)
        As ``model.compile``'s; ``loss_weights`` likewise.
    metrics : list
        As ``model.compile``'s; averaged over the epoch's rows, in the history, and with
        ``val_`` on the validation rows.
    callbacks : list of keras.callbacks.Callback
        Run by ``model.fit`` on every rank, after the epoch's metrics are averaged and
        the validation metrics are added. ``checkpoint_callback``: one more, on rank 0.
    custom_objects : dict
        For loading the model, optimizer, losses and metrics (``keras.saving``).
    feature_cols, label_cols, sample_weight_col, validation, batch_size, val_batch_size,
    epochs, train_steps_per_epoch, validation_steps_per_epoch, shuffle, random_seed,
    partitions_per_process, store, run_id, num_proc, verbose, label_shapes :
        As Horovod's (see the README, Spark → Estimators).
    gradient_compression : optional
        ``ringreduce.keras.Compression.fp16`` and friends.
    backward_passes_per_step : int
        Batches whose gradients are accumulated before one averaged step.
    """

    _WHAT = "KerasEstimator"

    def _payload(self) -> dict:
        from ..exceptions import InvalidInputError

        model, opt = self.getOrDefault("model"), self.getOrDefault("optimizer")
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise InvalidInputError(f"{self._WHAT}.fit: optimizer must be a Keras optimizer, "
                                    f"got {type(opt).__name__}")
        loss = self.getOrDefault("loss")
        if loss is None:
            raise InvalidInputError(f"{self._WHAT}.fit: loss is required")
        return {"model": model_bytes(model), "optimizer": keras.optimizers.serialize(opt),
                "loss": _to_wire(loss, keras.losses.Loss, "losses"),
                "metrics": _to_wire(list(self.getOrDefault("metrics") or []),
                                    keras.metrics.Metric, "metrics")}

    def _remote(self) -> Callable[[TrainSpec], Any]:
        return _train

    def _make_model(self, weights: Any, history: dict, run_id: str) -> KerasModel:
        custom = self.getOrDefault("custom_objects") or {}
        model = load_model_bytes(model_bytes(self.getOrDefault("model")), custom)
        model.set_weights(weights)
        return KerasModel(model=model, feature_columns=self.getOrDefault("feature_cols"),
                          label_columns=self.getOrDefault("label_cols"), history=history,
                          run_id=run_id, custom_objects=custom)


@with_params({"custom_objects": {}})
class KerasModel(ModelBase):
    """A trained Keras model; ``transform(df)`` adds ``<label>__output`` columns and
    ``getModel()`` is the ``keras.Model``."""

    _WHAT = "KerasModel"

    def _predictor(self) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
        return _Predictor(model_bytes(self.getOrDefault("model")),
                          self.getOrDefault("custom_objects") or {})

    def _model_to_bytes(self) -> bytes:
        return model_bytes(self.getOrDefault("model"))

    @classmethod
    def _model_from_bytes(cls, data: bytes, params: dict) -> keras.Model:
        return load_model_bytes(data, params.get("custom_objects"))


class _Predictor:
    """The model as ``.keras`` bytes, loaded once per process on first use."""

    def __init__(self, data: bytes, custom_objects: dict) -> None:
        self.data, self.custom_objects = data, custom_objects
        self._model: Any = None

    def __getstate__(self) -> dict:
        return {"data": self.data, "custom_objects": self.custom_objects, "_model": None}

    def __call__(self, features: list[np.ndarray]) -> list[np.ndarray]:
        if self._model is None:
            self._model = load_model_bytes(self.data, self.custom_objects)
        out = self._model.predict_on_batch(_inputs(self._model, features))
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [np.asarray(keras.ops.convert_to_numpy(o)) for o in outs]


# ------------------------------------------------------------------ serialization
def model_bytes(model: keras.Model) -> bytes:
    """``model`` as the bytes of a ``.keras`` file."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def load_model_bytes(data: bytes, custom_objects: Optional[dict] = None) -> keras.Model:
    """The model saved in ``data`` (``model_bytes``), not compiled."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects or {},
                                       compile=False)


def _to_wire(obj: Any, cls: type, module: str) -> Any:
    """Keras loss or metric objects as their configs (``("keras", module, config)``);
    strings and other callables as they are (Spark pickles them); lists item by item."""
    if isinstance(obj, (list, tuple)):
        return [_to_wire(o, cls, module) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_wire(v, cls, module) for k, v in obj.items()}
    if isinstance(obj, cls):
        return ("keras", module, getattr(keras, module).serialize(obj))
    return obj


def _from_wire(obj: Any, custom_objects: dict) -> Any:
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "keras":
        return getattr(keras, obj[1]).deserialize(obj[2], custom_objects=custom_objects)
    if isinstance(obj, list):
        return [_from_wire(o, custom_objects) for o in obj]
    if isinstance(obj, dict):
        return {k: _from_wire(v, custom_objects) for k, v in obj.items()}
    return obj


def _numpy(v: Any) -> np.ndarray:
    return np.array(v.numpy() if hasattr(v, "numpy") else keras.ops.convert_to_numpy(v))


# ------------------------------------------------------------------ arrays
def _inputs(model: keras.Model, arrays: list[np.ndarray]) -> Any:
    """The model's input(s): floating arrays as float32, each reshaped to its model
    input's shape when that is known and differs; one input alone, several as a list."""
    try:
        shapes = [tuple(i.shape[1:]) for i in model.inputs]
    except (AttributeError, ValueError, TypeError):
        shapes = []
    out = []
    for i, a in enumerate(arrays):
        a = _cast(a)
        shape = shapes[i] if i < len(shapes) else None
        if shape is not None and None not in shape and a.shape[1:] != shape:
            a = a.reshape(-1, *shape)
        out.append(a)
    return out[0] if len(out) == 1 else out


def _cast(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype.kind in "fb" else a


def _columns(spec: TrainSpec, model: keras.Model, batch: dict) -> tuple:
    """``(x, y)`` or ``(x, y, sample_weight)`` of one batch; several inputs or labels as
    tuples (``tf.data`` refuses lists in a generator's batches)."""
    p = spec.params
    x = _inputs(model, [batch[c] for c in p["feature_cols"]])
    x = tuple(x) if isinstance(x, list) else x
    shapes = p["label_shapes"]
    ys = [_cast(batch[c]) if not shapes else _cast(batch[c]).reshape(shapes[i])
          for i, c in enumerate(p["label_cols"])]
    y = ys[0] if len(ys) == 1 else tuple(ys)
    if p["sample_weight_col"]:
        return x, y, batch[p["sample_weight_col"]].astype(np.float32)
    return x, y


# ------------------------------------------------------------------ on a rank
def _train(spec: TrainSpec) -> Any:
    """One rank of a fit: the loop of Horovod's KerasEstimator."""
    import ringreduce as rr
    import ringreduce.keras as hvd

    hvd.init()
    p = spec.params
    keras.utils.set_random_seed(spec.seed())
    model = _compiled(spec, hvd)
    resume = load_resume(rr._comm(), spec)
    history: dict = {}
    if resume is not None:
        try:
            model.set_weights(resume["model"])
        except ValueError as e:  # every rank has the same checkpoint: all raise alike
            raise mismatched_checkpoint("KerasEstimator", spec, e) from e
        _restore_optimizer(model.optimizer, resume.get("optimizer"))
        history = resume["history"]
    hvd.broadcast_global_variables(0, model)
    start, epochs = len(history.get("loss", [])), int(p["epochs"])
    if start < epochs:
        steps = spec.steps_per_epoch(rr.size())
        data = RankData(spec.train[rr.rank()])
        val = RankData(spec.val[rr.rank()]) if spec.val_rows else None
        callbacks = [hvd.callbacks.MetricAverageCallback(), _EpochEnd(spec, val, history),
                     *(p["callbacks"] or [])]
        with _checkpoint_callback(p["checkpoint_callback"], rr.rank()) as best:
            model.fit(_batches(spec, model, data, start, epochs, steps), steps_per_epoch=steps,
                      initial_epoch=start, epochs=epochs, verbose=0, shuffle=False,
                      callbacks=callbacks + ([best.callback] if best else []))
            if best and best.written():
                model.load_weights(best.path)  # the model returned is the one found best
    if rr.rank() != 0:
        return None
    return {"weights": model.get_weights(), "history": history}


class _Best:
    """Rank 0's ``checkpoint_callback`` and the one file its best model is in (None when
    its path has ``{epoch}``-style fields, it keeps more than the best, or it saves every
    ``save_freq`` batches, whose logs hold no validation values)."""

    def __init__(self, callback: Any, path: Optional[str]) -> None:
        self.callback, self.path = callback, path
        self._before = self._stamp()

    def _stamp(self) -> Optional[tuple]:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def written(self) -> bool:
        """Whether this fit wrote the file (a file of an earlier run, never beaten by
        ``initial_value_threshold``, is not this fit's model)."""
        now = self._stamp()
        return now is not None and now != self._before


@contextlib.contextmanager
def _checkpoint_callback(callback: Any, rank: int) -> Iterator[Optional[_Best]]:
    """Horovod's rule: ``checkpoint_callback`` runs on rank 0, and a ``ModelCheckpoint``
    with ``save_best_only`` gives the fit's model. One without a ``filepath``
    (``BestModelCheckpoint()``) writes into a directory of this task, removed after."""
    if callback is None or rank != 0:
        yield None
        return
    best_only = getattr(callback, "save_best_only", False)
    with tempfile.TemporaryDirectory(prefix="rr-best-") as d:
        if best_only and getattr(callback, "filepath", "") is None:
            weights = getattr(callback, "save_weights_only", False)
            callback.filepath = os.path.join(d, "best.weights.h5" if weights else "best.keras")
        path = getattr(callback, "filepath", None)
        one_file = best_only and isinstance(path, str) and "{" not in path \
            and getattr(callback, "save_freq", "epoch") == "epoch"
        yield _Best(callback, path if one_file else None)


def _compiled(spec: TrainSpec, hvd: Any) -> keras.Model:
    """The rank's model, compiled with its DistributedOptimizer, optimizer built."""
    p, pay = spec.params, spec.payload
    custom = p["custom_objects"] or {}
    model = load_model_bytes(pay["model"], custom)
    opt = keras.optimizers.deserialize(pay["optimizer"], custom_objects=custom)
    dopt = hvd.DistributedOptimizer(
        opt, compression=p["gradient_compression"] or hvd.Compression.none,
        backward_passes_per_step=int(p["backward_passes_per_step"]),
        average_aggregated_gradients=True)  # the mean of k batches, as TorchEstimator
    # XLA cannot compile ringreduce.tensorflow's collectives (Python calls)
    jit: Any = False if keras.backend.backend() == "tensorflow" else "auto"
    model.compile(optimizer=dopt, loss=_from_wire(pay["loss"], custom),
                  loss_weights=p["loss_weights"], metrics=_from_wire(pay["metrics"], custom),
                  jit_compile=jit)
    dopt.build(model.trainable_variables)
    return model


def _restore_optimizer(opt: Any, saved: Optional[list]) -> None:
    """The checkpoint's optimizer variables into ``opt`` (built), where the shapes match."""
    for v, a in zip(opt.variables, saved or []):
        if tuple(v.shape) == np.shape(a):
            v.assign(a)


def _batches(spec: TrainSpec, model: keras.Model, data: RankData, start: int, epochs: int,
             steps: int) -> Any:
    """Every remaining epoch's ``steps`` batches, in one stream (``fit`` takes ``steps``
    per epoch from it)."""
    import ringreduce as rr

    p = spec.params
    for epoch in range(start, epochs):
        for batch in data.batches(epoch, steps, int(p["batch_size"]), bool(p["shuffle"]),
                                  spec.seed() * 1000 + rr.rank()):
            yield _columns(spec, model, batch)


class _EpochEnd(keras.callbacks.Callback):
    """After ``MetricAverageCallback``: the exact validation metrics into the logs, the
    epoch into the history, the run's checkpoint (rank 0)."""

    def __init__(self, spec: TrainSpec, val: Optional[RankData], history: dict) -> None:
        super().__init__()
        self.spec, self.val, self.history = spec, val, history

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        import ringreduce as rr

        logs = logs if logs is not None else {}
        if self.val is not None:
            logs.update({f"val_{k}": v for k, v in _evaluate(self.spec, self.model,
                                                             self.val).items()})
        row = {k: float(v) for k, v in logs.items() if np.ndim(v) == 0}
        opt = self.model.optimizer
        end_epoch(rr._comm(), self.spec, epoch, row, self.history, {
            "model": self.model.get_weights(),
            "optimizer": [_numpy(v) for v in opt.variables] if opt is not None else None})


def _evaluate(spec: TrainSpec, model: keras.Model, val: RankData) -> dict[str, float]:
    """Loss and metrics over this rank's validation rows, averaged over every rank's rows
    (``test_on_batch`` per batch, weighted by its rows)."""
    import ringreduce as rr

    sums: dict[str, float] = {"loss": 0.0}
    n = 0
    steps = spec.params["validation_steps_per_epoch"]
    for batch in val.in_order(spec.val_batch_size(), steps and int(steps)):
        cols = _columns(spec, model, batch)
        logs = model.test_on_batch(*cols, return_dict=True)
        rows = len(batch[spec.params["label_cols"][0]])
        for k, v in logs.items():
            if np.ndim(v) == 0:
                sums[k] = sums.get(k, 0.0) + float(v) * rows
        n += rows
    return mean_across(rr._comm(), sums, n)
