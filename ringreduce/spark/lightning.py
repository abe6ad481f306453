"""``TorchEstimator`` for PyTorch Lightning: Horovod's ``horovod.spark.lightning``, a
``LightningModule`` trained on a Spark DataFrame by ``num_proc`` ranks, each running a
Lightning ``Trainer`` with ringreduce's strategy, and returned as a ``TorchModel``::

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.lightning import TorchEstimator

    est = TorchEstimator(num_proc=2, store=Store.create("/shared/runs"), model=module,
                         feature_cols=["features"], label_cols=["y"], batch_size=32,
                         epochs=5, validation=0.1)
    fitted = est.fit(df)                  # ringreduce.spark.torch.TorchModel
    fitted.transform(df).select("y__output")

The module's ``training_step(batch, batch_idx)`` gets a dict of tensors keyed by column
name (Horovod's convention: ``batch["features"]``, ``batch["y"]``), its
``configure_optimizers`` makes the optimizer and its ``forward(*features)`` predicts in
``transform``. The fit's steps are ``_estimator.py``'s; what each rank runs is
``_lightning_remote.py``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..exceptions import InvalidInputError
from ._estimator import COMMON_PARAMS, EstimatorBase, TrainSpec, with_params
from .torch import TorchModel, fitted_model

__all__ = ["TorchEstimator", "TorchModel"]

_LIGHTNING_PARAMS = {
    "input_shapes": None, "loss_constructors": None, "train_minibatch_fn": None,
    "num_gpus": None, "logger": None, "log_every_n_steps": 50, "data_module": None,
    "loader_num_epochs": None, "terminate_on_nan": False, "profiler": None,
    "trainer_args": None, "debug_data_loader": False,
    "train_async_data_loader_queue_size": None, "val_async_data_loader_queue_size": None,
    "mp_start_method": None,
}


@with_params({**COMMON_PARAMS, **_LIGHTNING_PARAMS})
class TorchEstimator(EstimatorBase):
    """Horovod's Lightning ``TorchEstimator``: ``fit(df)`` runs ``Trainer.fit`` of
    ``model`` on ``num_proc`` ranks and returns a ``TorchModel``.

    Parameters (keywords, or Horovod's ``setX`` methods)
    ----------
    model : LightningModule
        Of ``lightning.pytorch`` or ``pytorch_lightning``. Batches come to its
        ``training_step``/``validation_step`` as dicts of tensors keyed by column name
        (floating columns as float32, integer ones as int64; reshaped to
        ``input_shapes``/``label_shapes`` if given); ``optimizer`` and ``loss`` are not
        used (``configure_optimizers`` and the steps are the module's).
    callbacks : list of Lightning callbacks
        Run on every rank. A ``ModelCheckpoint`` among them writes into the store's run
        directory (unless it has a ``dirpath``), and its best checkpoint is the model
        returned, as in Horovod.
    trainer_args : dict, optional
        Added to (and overriding) the ``Trainer`` arguments the estimator chooses.
    logger, log_every_n_steps, profiler, terminate_on_nan, gradient_compression, use_gpu :
        As Horovod's: the Trainer's logger (none by default), logging interval, profiler;
        stop with an error when a training loss is not finite; the gradients' compression
        (``ringreduce.torch.Compression.fp16``...); one GPU per rank when torch sees one.
    feature_cols, label_cols, sample_weight_col, validation, batch_size, val_batch_size,
    epochs, train_steps_per_epoch, validation_steps_per_epoch, shuffle, random_seed,
    partitions_per_process, store, run_id, num_proc, verbose :
        As Horovod's (see the README, Spark → Estimators).
    """

    _WHAT = "TorchEstimator (Lightning)"
    _REQUIRED = ("model", "feature_cols", "label_cols", "store")

    def _payload(self) -> dict:
        model = self.getOrDefault("model")
        package = lightning_package(model)
        if package is None:
            raise InvalidInputError(
                f"{self._WHAT}.fit: model must be a LightningModule (lightning.pytorch or "
                f"pytorch_lightning), got {type(model).__name__}; for a plain torch.nn.Module "
                "with an optimizer and a loss use ringreduce.spark.torch.TorchEstimator")
        for name, why in (("data_module", "it reads Petastorm datasets; batches come from "
                                          "the store's parts here"),
                          ("train_minibatch_fn", "the LightningModule's training_step is the "
                                                 "step")):
            if self.getOrDefault(name) is not None:
                raise InvalidInputError(f"{self._WHAT}.fit: {name} is not supported ({why})")
        args = self.getOrDefault("trainer_args")
        if args is not None and not isinstance(args, dict):
            raise InvalidInputError(f"{self._WHAT}.fit: trainer_args must be a dict of Trainer "
                                    f"arguments, got {type(args).__name__}")
        return {"model": model, "package": package}

    def _remote(self) -> Callable[[TrainSpec], Any]:
        from ._lightning_remote import train

        return train

    def _make_model(self, weights: Any, history: dict, run_id: str) -> TorchModel:
        return fitted_model(self, weights, history, run_id)


def lightning_package(model: Any) -> str | None:
    """"lightning.pytorch" or "pytorch_lightning", whichever ``model``'s class derives from."""
    import importlib
    import sys

    for package in ("lightning.pytorch", "pytorch_lightning"):
        if package.split(".")[0] not in sys.modules:
            continue  # the model's class was defined with what is imported already
        module = importlib.import_module(package)
        if isinstance(model, module.LightningModule):
            return package
    return None
