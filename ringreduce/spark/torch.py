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
runs is ``_train`` below: ``ringreduce.torch.DistributedOptimizer`` around a rebuilt copy of
the user's optimizer, parameters and optimizer state broadcast from rank 0 (after a resume,
rank 0's checkpoint), ``model(*features)`` per batch, ``loss(output, label)`` per label
column weighted by ``loss_weights``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from ._estimator import (
    COMMON_PARAMS,
    EstimatorBase,
    ModelBase,
    RankData,
    TrainSpec,
    load_resume,
    mean_across,
    save_epoch,
    with_params,
)

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
        Batches whose gradients are accumulated before one averaged step.
    train_minibatch_fn : callable, optional
        Horovod's custom step: ``train_minibatch_fn()`` returns ``step(model, optimizer,
        transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs, loss)``
        (for example an LBFGS step with a closure); the default is ``_train_minibatch``.
    """

    _WHAT = "TorchEstimator"

    def _payload(self) -> dict:
        model, opt = self.getOrDefault("model"), self.getOrDefault("optimizer")
        return {"model": model, "optimizer": _optimizer_recipe(model, opt),
                "loss": _losses(self), "metrics": list(self.getOrDefault("metrics") or [])}

    def _remote(self) -> Callable[[TrainSpec], Any]:
        return _train

    def _make_model(self, weights: Any, history: dict, run_id: str) -> TorchModel:
        import torch

        model = copy.deepcopy(self.getOrDefault("model"))
        model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        return TorchModel(model=model, feature_columns=self.getOrDefault("feature_cols"),
                          label_columns=self.getOrDefault("label_cols"), history=history,
                          run_id=run_id, input_shapes=self.getOrDefault("input_shapes"))


@with_params({"input_shapes": None})
class TorchModel(ModelBase):
    """A trained PyTorch model; ``transform(df)`` adds ``<label>__output`` columns and
    ``getModel()`` is the ``torch.nn.Module``."""

    _WHAT = "TorchModel"

    def _predictor(self) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
        return _Predictor(self.getOrDefault("model"), self.getOrDefault("input_shapes"))


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
    return {"cls": type(opt), "defaults": dict(opt.defaults), "groups": groups,
            "state": opt.state_dict()}


def _losses(est: TorchEstimator) -> list:
    made = est.getOrDefault("loss_constructors")
    loss = [c() for c in made] if made else est.getOrDefault("loss")
    if loss is None:
        from ..exceptions import InvalidInputError

        raise InvalidInputError("TorchEstimator.fit: loss (or loss_constructors) is required")
    losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
    labels = est.getOrDefault("label_cols")
    return losses * len(labels) if len(losses) == 1 else losses


def _tensors(arrays: list[np.ndarray], shapes: Any) -> list:
    import torch

    out = []
    for i, a in enumerate(arrays):
        t = torch.from_numpy(np.ascontiguousarray(a))
        t = t.float() if t.is_floating_point() else t.long() if t.dtype != torch.bool else t
        if shapes:
            t = t.reshape(*shapes[i])
        out.append(t)
    return out


def _rebuild_optimizer(recipe: dict, model: Any) -> Any:
    params = list(model.parameters())
    groups = [{**g, "params": [params[i] for i in g["params"]]} for g in recipe["groups"]]
    opt = recipe["cls"](groups, **recipe["defaults"])
    opt.load_state_dict(recipe["state"])
    return opt


def _train(spec: TrainSpec) -> Any:
    """One rank of a fit: the loop of Horovod's TorchEstimator."""
    import torch

    import ringreduce as rr
    import ringreduce.torch as hvd

    hvd.init()
    p, pay = spec.params, spec.payload
    torch.manual_seed(spec.seed())
    model = pay["model"].to(_device(spec))
    opt = _rebuild_optimizer(pay["optimizer"], model)
    resume = load_resume(rr._comm(), spec)
    history: dict = {}
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        history = resume["history"]
    start = len(history.get("loss", []))
    dopt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(),
        compression=p["gradient_compression"] or hvd.Compression.none,
        backward_passes_per_step=int(p["backward_passes_per_step"]))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    data = RankData(spec.train[rr.rank()])
    val = RankData(spec.val[rr.rank()]) if spec.val_rows else None
    for epoch in range(start, int(p["epochs"])):
        row = _epoch(spec, model, dopt, data, epoch)
        if val is not None:
            row.update({f"val_{k}": v for k, v in _evaluate(spec, model, val).items()})
        for k, v in row.items():
            history.setdefault(k, []).append(v)
        if p["verbose"] and rr.rank() == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.6g}" for k, v in row.items()),
                  flush=True)
        save_epoch(rr._comm(), spec, {"model": model.state_dict(),
                                      "optimizer": opt.state_dict(), "history": history})
    if rr.rank() != 0:
        return None
    return {"weights": {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()},
            "history": history}


def _device(spec: TrainSpec) -> Any:
    """This rank's GPU (``cuda:<local rank>``) with ``use_gpu`` where torch sees one, else
    the CPU (Horovod's rule)."""
    import torch

    import ringreduce as rr

    if spec.params["use_gpu"] and torch.cuda.is_available():
        return torch.device("cuda", rr.local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _columns(spec: TrainSpec, batch: dict) -> tuple[list, list, Any]:
    p, device = spec.params, _device(spec)
    inputs = [t.to(device) for t in _tensors([batch[c] for c in p["feature_cols"]],
                                             p["input_shapes"])]
    labels = [t.to(device) for t in _tensors([batch[c] for c in p["label_cols"]],
                                             p["label_shapes"])]
    weights = p["sample_weight_col"] and _tensors([batch[p["sample_weight_col"]]],
                                                  None)[0].to(device)
    return inputs, labels, weights


def _loss(spec: TrainSpec, outputs: Any, labels: list, weights: Any) -> Any:
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    lw = spec.params["loss_weights"] or [1.0] * len(labels)
    total = 0
    for fn, w, out, lab in zip(spec.payload["loss"], lw, outputs, labels):
        value = fn(out, lab)
        if weights is not None:
            if value.dim() == 0:
                from ..exceptions import InvalidInputError

                raise InvalidInputError("TorchEstimator: with sample_weight_col the loss must "
                                        "return one value per row (reduction='none')")
            value = (value.reshape(-1) * weights).sum() / weights.sum()
        total = total + w * value
    return total


def _metrics(spec: TrainSpec, outputs: Any, labels: list) -> dict[str, float]:
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    out = {}
    for i, fn in enumerate(spec.payload["metrics"]):
        name = getattr(fn, "__name__", f"metric{i}")
        out[name] = float(fn(outputs[0], labels[0]))
    return out


def _train_minibatch(model: Any, optimizer: Any, transform_outputs: Callable,
                     loss_fn: Callable, inputs: list, labels: list, sample_weights: Any
                     ) -> tuple[Any, Any]:
    """One step, the default of Horovod's ``train_minibatch_fn`` (same signature)."""
    optimizer.zero_grad()
    outputs, labels = transform_outputs(model(*inputs), labels)
    loss = loss_fn(outputs, labels, sample_weights)
    loss.backward()
    optimizer.step()
    return outputs, loss


def _same(outputs: Any, labels: list) -> tuple[Any, list]:
    """Horovod's ``transform_outputs`` for a custom step: the loss takes outputs as the
    model gives them (one tensor, or one per label column)."""
    return outputs, labels


def _epoch(spec: TrainSpec, model: Any, dopt: Any, data: RankData, epoch: int) -> dict:
    """One epoch of ``steps_per_epoch`` steps; the loss and metrics averaged over ranks."""
    import ringreduce as rr

    p = spec.params
    model.train()
    step = p["train_minibatch_fn"]() if p["train_minibatch_fn"] else _train_minibatch

    def loss_fn(outputs: Any, labels: list, weights: Any) -> Any:
        return _loss(spec, outputs, labels, weights)

    sums: dict[str, float] = {"loss": 0.0}
    n = 0
    for batch in data.batches(epoch, spec.steps_per_epoch(rr.size()), int(p["batch_size"]),
                              bool(p["shuffle"]), spec.seed() * 1000 + rr.rank()):
        inputs, labels, weights = _columns(spec, batch)
        outputs, loss = step(model, dopt, _same, loss_fn, inputs, labels, weights)
        rows = len(labels[0])
        sums["loss"] += float(loss.detach()) * rows
        for k, v in _metrics(spec, outputs, labels).items():
            sums[k] = sums.get(k, 0.0) + v * rows
        n += rows
    return mean_across(rr._comm(), sums, n)


def _evaluate(spec: TrainSpec, model: Any, val: RankData) -> dict[str, float]:
    """Loss and metrics over this rank's validation rows, averaged over every rank's rows."""
    import torch

    import ringreduce as rr

    model.eval()
    sums: dict[str, float] = {"loss": 0.0}
    n = 0
    steps = spec.params["validation_steps_per_epoch"]
    with torch.no_grad():
        for batch in val.in_order(spec.val_batch_size(), steps and int(steps)):
            inputs, labels, weights = _columns(spec, batch)
            outputs = model(*inputs)
            rows = len(labels[0])
            sums["loss"] += float(_loss(spec, outputs, labels, weights)) * rows
            for k, v in _metrics(spec, outputs, labels).items():
                sums[k] = sums.get(k, 0.0) + v * rows
            n += rows
    return mean_across(rr._comm(), sums, n)
