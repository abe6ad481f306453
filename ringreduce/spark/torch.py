"""``TorchEstimator`` and ``TorchModel``: Horovod's ``horovod.spark.torch``, a PyTorch model
trained on a Spark DataFrame by ``num_proc`` ranks in Spark tasks and returned as a Spark
ML ``Model``::

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.torch import TorchEstimator

    est = TorchEstimator(num_proc=2, store=Store.create("/shared/runs"), model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["y"], batch_size=32, epochs=5, validation=0.1)
    fitted = est.fit(df)                  # a TorchModel
    fitted.transform(df).select("y__output")

What a fit does, step by step, is in ``ringreduce/spark/_estimator.py``; the loop each rank
runs is ``train`` in ``_torch_remote.py``: ``ringreduce.torch.DistributedOptimizer`` around
a copy of the user's optimizer, parameters and optimizer state broadcast from rank 0 (after
a resume, rank 0's checkpoint), ``model(*features)`` per batch, ``loss(output, label)`` per
label column weighted by ``loss_weights``.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import numpy as np

from ._estimator import COMMON_PARAMS, EstimatorBase, ModelBase, TrainSpec, with_params

__all__ = ["TorchEstimator", "TorchModel"]


@with_params({**COMMON_PARAMS, "input_shapes": None, "loss_constructors": None,
              "backward_passes_per_step": 1, "train_minibatch_fn": None})
class TorchEstimator(EstimatorBase):
    """Horovod's ``TorchEstimator``: ``fit(df)`` trains ``model`` with ``optimizer`` on
    ``num_proc`` ranks and returns a ``TorchModel``.

    Parameters (keywords, or Horovod's ``setX`` methods)
    ----------
    model : torch.nn.Module
        Called as ``model(*features)``, one tensor per feature column (floating columns as
        float32, integer ones as int64), reshaped to ``input_shapes`` if given.
    optimizer : torch.optim.Optimizer
        Built on ``model.parameters()``; each rank trains a copy with the same class,
        parameter groups, hyperparameters and state.
    loss : callable or list of callables
        ``loss(output, label)`` per label column (or one for all); with
        ``sample_weight_col`` it must return one value per row (``reduction="none"``),
        and the weighted mean is taken. ``loss_constructors``: callables returning them.
    loss_weights : list of float, optional
        Weights of the label columns' losses.
    metrics : list of callables
        ``metric(output, label)`` per batch, averaged over the epoch's rows, named by
        ``__name__``; in the history, and with ``val_`` on the validation rows.
    feature_cols, label_cols, sample_weight_col, validation, batch_size, val_batch_size,
    epochs, train_steps_per_epoch, validation_steps_per_epoch, shuffle, random_seed,
    partitions_per_process, store, run_id, num_proc, verbose :
        As Horovod's (see the README, Spark → Estimators).
    gradient_compression : optional
        ``ringreduce.torch.Compression.fp16`` and friends.
    backward_passes_per_step : int
        Batches whose mean gradient makes one averaged step (an epoch's leftover batches
        make one more at its end).
    train_minibatch_fn : callable, optional
        Horovod's custom step: ``train_minibatch_fn()`` returns ``step(model, optimizer,
        transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs, loss)``
        (for example an LBFGS step with a closure), which zeroes and steps itself.
    """

    _WHAT = "TorchEstimator"

    def _payload(self) -> dict:
        model, opt = self.getOrDefault("model"), self.getOrDefault("optimizer")
        return {"model": model, "optimizer": _optimizer_recipe(model, opt),
                "loss": _losses(self), "metrics": _metric_specs(self)}

    def _remote(self) -> Callable[[TrainSpec], Any]:
        from ._torch_remote import train

        return train

    def _make_model(self, weights: Any, history: dict, run_id: str) -> TorchModel:
        return fitted_model(self, weights, history, run_id)


@with_params({"input_shapes": None})
class TorchModel(ModelBase):
    """A trained PyTorch model; ``transform(df)`` adds ``<label>__output`` columns and
    ``getModel()`` is the ``torch.nn.Module``."""

    _WHAT = "TorchModel"

    def _predictor(self) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
        return _Predictor(self.getOrDefault("model"), self.getOrDefault("input_shapes"))

    def _model_to_bytes(self) -> bytes:
        import io

        import torch
        from pyspark import cloudpickle

        buf = io.BytesIO()
        # by value where the class is the user's __main__'s (a notebook's, a script's)
        torch.save(self.getOrDefault("model"), buf, pickle_module=cloudpickle)
        return buf.getvalue()

    @classmethod
    def _model_from_bytes(cls, data: bytes, params: dict) -> Any:
        import io

        import torch

        # the whole module, as torch.save wrote it, on the CPU (saved from a GPU or not)
        return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


def fitted_model(est: Any, weights: Any, history: dict, run_id: str) -> TorchModel:
    """A copy of ``est``'s module with rank 0's trained ``weights``, as a TorchModel."""
    import torch

    model = copy.deepcopy(est.getOrDefault("model"))
    model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    return TorchModel(model=model, feature_columns=est.getOrDefault("feature_cols"),
                      label_columns=est.getOrDefault("label_cols"), history=history,
                      run_id=run_id, input_shapes=est.getOrDefault("input_shapes"))


class _Predictor:
    def __init__(self, model: Any, shapes: Any) -> None:
        self.model, self.shapes = model, shapes

    def __call__(self, features: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        self.model.eval()
        with torch.no_grad():
            out = self.model(*_tensors(features, self.shapes))
        return [o.detach().cpu().numpy() for o in (out if isinstance(out, (list, tuple))
                                                   else [out])]


def _optimizer_recipe(model: Any, opt: Any) -> dict:
    """How to rebuild ``opt`` on a copy of ``model``: its class, its parameter groups as
    indices into ``model.parameters()``, and its state."""
    from ..exceptions import InvalidInputError

    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = []
    for g in opt.param_groups:
        missing = [p for p in g["params"] if id(p) not in index]
        if missing:
            raise InvalidInputError("TorchEstimator.fit: the optimizer holds parameters that "
                                    "are not the model's; build it on model.parameters()")
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [index[id(p)] for p in g["params"]]})
    # only what the constructor takes (AdamW's defaults hold a flag its __init__ does not);
    # load_state_dict restores every group's hyperparameters anyway
    takes = inspect.signature(type(opt)).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in takes}
    return {"cls": type(opt), "defaults": defaults, "groups": groups,
            "state": opt.state_dict()}


def _losses(est: TorchEstimator) -> list:
    made = est.getOrDefault("loss_constructors")
    loss = [c() for c in made] if made else est.getOrDefault("loss")
    if loss is None:
        from ..exceptions import InvalidInputError

        raise InvalidInputError("TorchEstimator.fit: loss (or loss_constructors) is required")
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    labels = est.getOrDefault("label_cols")
    if len(losses) not in (1, len(labels)):
        from ..exceptions import InvalidInputError

        raise InvalidInputError(f"TorchEstimator.fit: {len(losses)} losses for "
                                f"{len(labels)} label columns: give one, or one per column")
    return losses * len(labels) if len(losses) == 1 else losses


def _metric_specs(est: TorchEstimator) -> list[tuple[str, Any, int]]:
    """``(name, metric, label index)`` per metric and label column: the metric's
    ``__name__``, prefixed ``<label>_`` when there are several label columns."""
    from ..exceptions import InvalidInputError

    labels = est.getOrDefault("label_cols")
    specs = []
    for fn in est.getOrDefault("metrics") or []:
        base = getattr(fn, "__name__", type(fn).__name__)
        specs += [(base if len(labels) == 1 else f"{label}_{base}", fn, i)
                  for i, label in enumerate(labels)]
    names = [n for n, _, _ in specs]
    clash = sorted({n for n in names if names.count(n) > 1 or n == "loss"})
    if clash:
        raise InvalidInputError(f"TorchEstimator.fit: metric name(s) {clash} repeat or are "
                                "'loss': give each metric a __name__ of its own")
    return specs


def _tensors(arrays: list[np.ndarray], shapes: Any) -> list:
    import torch

    out = []
    for i, a in enumerate(arrays):
        t = torch.from_numpy(np.ascontiguousarray(a))
        t = t.long() if not (t.is_floating_point() or t.dtype == torch.bool) else t.float()
        if shapes:
            t = t.reshape(*shapes[i])
        out.append(t)
    return out
