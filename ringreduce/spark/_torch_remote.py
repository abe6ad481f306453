"""What a rank of a ``TorchEstimator`` fit runs (Horovod's ``horovod/spark/torch/remote.py``).

Per epoch, every rank takes ``steps_per_epoch`` batches of its own rows. The default step
accumulates ``backward_passes_per_step`` batches (each loss divided by their number, so the
gradient is their mean) and then takes one averaged optimizer step; an epoch whose step
count is not a multiple of it steps once more at its end on the mean of what it has, so no
epoch leaks gradients into the next. A ``train_minibatch_fn`` replaces the step and does its own
``zero_grad``/``step``. Labels are reshaped to their output's shape where the element
counts agree (Horovod's ``transform_outputs``), so ``mse_loss`` of an ``(N, 1)`` output
and a column of doubles compares row with row instead of broadcasting to ``(N, N)``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..exceptions import InvalidInputError
from ._estimator import (
    RankData,
    TrainSpec,
    end_epoch,
    load_resume,
    mean_across,
    mismatched_checkpoint,
)
from .torch import _tensors


def train(spec: TrainSpec) -> Any:
    """One rank of a fit; rank 0 returns the weights (numpy) and the history."""
    import torch

    import ringreduce as rr
    import ringreduce.torch as hvd

    hvd.init()
    p, pay = spec.params, spec.payload
    torch.manual_seed(spec.seed())
    model = pay["model"].to(_device(spec))
    opt = _rebuild_optimizer(pay["optimizer"], model)
    history = _resume(spec, model, opt, load_resume(rr._comm(), spec))
    dopt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(),
        compression=p["gradient_compression"] or hvd.Compression.none,
        backward_passes_per_step=int(p["backward_passes_per_step"]))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    data = RankData(spec.train[rr.rank()])
    val = RankData(spec.val[rr.rank()]) if spec.val_rows else None
    for epoch in range(len(history.get("loss", [])), int(p["epochs"])):
        row = _epoch(spec, model, dopt, data, epoch)
        if val is not None:
            row.update({f"val_{k}": v for k, v in _evaluate(spec, model, val).items()})
        end_epoch(rr._comm(), spec, epoch, row, history,
                  {"model": model.state_dict(), "optimizer": opt.state_dict()})
    if rr.rank() != 0:
        return None
    return {"weights": {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()},
            "history": history}


def _rebuild_optimizer(recipe: dict, model: Any) -> Any:
    """The user's optimizer (``torch._optimizer_recipe``) on this rank's ``model``."""
    params = list(model.parameters())
    groups = [{**g, "params": [params[i] for i in g["params"]]} for g in recipe["groups"]]
    opt = recipe["cls"](groups, **recipe["defaults"])
    opt.load_state_dict(recipe["state"])
    return opt


def _resume(spec: TrainSpec, model: Any, opt: Any, saved: Any) -> dict:
    """The checkpoint's weights and optimizer state into ``model`` and ``opt`` (every rank
    has the same ``saved``, so every rank raises alike); its history, or a new one."""
    if saved is None:
        return {}
    try:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise mismatched_checkpoint("TorchEstimator", spec, e, "model or optimizer") from e
    return saved["history"]


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


def transform_outputs(outputs: Any, labels: list) -> tuple[list, list]:
    """Horovod's ``transform_outputs``: the outputs as a list (one per label column), each
    label viewed in its output's shape where their element counts agree."""
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return outputs, [lab.view(out.shape) if lab.numel() == out.numel() else lab
                     for out, lab in zip(outputs, labels)]


def _loss(spec: TrainSpec, outputs: list, labels: list, weights: Any) -> Any:
    lw = spec.params["loss_weights"] or [1.0] * len(labels)
    total = 0
    for fn, w, out, lab in zip(spec.payload["loss"], lw, outputs, labels):
        value = fn(out, lab)
        if weights is not None:
            if value.dim() == 0:
                raise InvalidInputError("TorchEstimator: with sample_weight_col the loss must "
                                        "return one value per row (reduction='none')")
            value = (value.reshape(-1) * weights).sum() / weights.sum()
        total = total + w * value
    return total


def _metrics(spec: TrainSpec, outputs: list, labels: list) -> dict[str, float]:
    return {name: float(fn(outputs[i], labels[i])) for name, fn, i in spec.payload["metrics"]}


class _Step:
    """The default step (Horovod's ``train_minibatch``), accumulating ``k`` batches."""

    def __init__(self, k: int) -> None:
        self.k, self.taken = k, 0

    def __call__(self, model: Any, optimizer: Any, transform: Callable, loss_fn: Callable,
                 inputs: list, labels: list, sample_weights: Any) -> tuple[list, Any]:
        if self.taken % self.k == 0:
            optimizer.zero_grad()
        outputs, labels = transform(model(*inputs), labels)
        loss = loss_fn(outputs, labels, sample_weights)
        (loss / self.k).backward()
        self.taken += 1
        if self.taken % self.k == 0:
            optimizer.step()
        return outputs, loss

    def finish(self, optimizer: Any) -> None:
        """The epoch's last, partial accumulation of ``r < k`` batches becomes a step of
        its own, on their mean gradient (each loss was divided by ``k``, not ``r``)."""
        r = self.taken % self.k
        if r:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(self.k / r)
            optimizer.step()
        self.taken = 0


def _epoch(spec: TrainSpec, model: Any, dopt: Any, data: RankData, epoch: int) -> dict:
    """One epoch of ``steps_per_epoch`` batches; the loss and metrics averaged over ranks."""
    import ringreduce as rr

    p = spec.params
    model.train()
    custom = p["train_minibatch_fn"]
    step = custom() if custom else _Step(int(p["backward_passes_per_step"]))

    def loss_fn(outputs: Any, labels: list, weights: Any) -> Any:
        return _loss(spec, *transform_outputs(outputs, labels), weights)

    sums: dict[str, float] = {"loss": 0.0}
    n = 0
    for batch in data.batches(epoch, spec.steps_per_epoch(rr.size()), int(p["batch_size"]),
                              bool(p["shuffle"]), spec.seed() * 1000 + rr.rank()):
        inputs, labels, weights = _columns(spec, batch)
        outputs, loss = step(model, dopt, transform_outputs, loss_fn, inputs, labels, weights)
        _add(sums, float(loss.detach()), _metrics(spec, *transform_outputs(outputs, labels)),
             len(labels[0]))
        n += len(labels[0])
    if not custom:
        step.finish(dopt)
    return mean_across(rr._comm(), sums, n)


def _add(sums: dict, loss: float, metrics: dict, rows: int) -> None:
    sums["loss"] += loss * rows
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v * rows


def _evaluate(spec: TrainSpec, model: Any, val: RankData) -> dict[str, float]:
    """Loss and metrics over this rank's validation rows, averaged over every rank's rows."""
    import torch

    import ringreduce as rr

    model.eval()
    sums: dict[str, float] = {"loss": 0.0}
    n = 0
    steps = spec.params["validation_steps_per_epoch"]
    with torch.no_grad():
        for batch in val.in_order(spec.val_batch_size(), steps):
            inputs, labels, weights = _columns(spec, batch)
            outputs, labels = transform_outputs(model(*inputs), labels)
            _add(sums, float(_loss(spec, outputs, labels, weights)),
                 _metrics(spec, outputs, labels), len(labels[0]))
            n += len(labels[0])
    return mean_across(rr._comm(), sums, n)
