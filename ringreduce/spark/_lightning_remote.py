"""What a rank of a Lightning ``TorchEstimator`` fit runs (Horovod's
``horovod/spark/lightning/remote.py``): one ``Trainer.fit`` with ringreduce's strategy.

Every rank's loaders read its own share of the parts (no DistributedSampler): training
yields exactly ``steps_per_epoch`` batches an epoch, wrapping around the share, so the
ranks make the same number of steps; validation reads the share once (or its first
``validation_steps_per_epoch`` batches). At each epoch's end (after validation) the
callback ``_EpochEnd`` records the Trainer's metrics in the history and rank 0 replaces
the run's checkpoint: Lightning's own checkpoint (weights, optimizers, schedulers, loops)
with the history. A fit with that ``run_id`` writes it to a local file on every rank and
passes it to ``Trainer.fit(ckpt_path=...)``, so the store needs to be readable by rank 0
only.
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile
from typing import Any, Callable, Optional

from ..exceptions import InvalidInputError
from ._estimator import RankData, TrainSpec, end_epoch, load_resume, mismatched_checkpoint
from .torch import _tensors


def train(spec: TrainSpec) -> Any:
    """One rank of a fit; rank 0 returns the weights (numpy) and the history."""
    import ringreduce as rr
    import ringreduce.torch as hvd

    hvd.init()
    p, model = spec.params, spec.payload["model"]
    pl = importlib.import_module(spec.payload["package"])
    _log_to_this_task()
    if p["random_seed"] is not None:
        pl.seed_everything(int(p["random_seed"]), verbose=False)
    saved = load_resume(rr._comm(), spec)
    history: dict = dict(saved["history"]) if saved else {}
    with tempfile.TemporaryDirectory(prefix="rr-lightning-") as tmp:
        resume = _resume_file(spec, model, saved, tmp)
        trainer = pl.Trainer(**_trainer_args(spec, pl, history, tmp))
        loaders = _loaders(spec, lambda: trainer.current_epoch)
        trainer.fit(model, *loaders, ckpt_path=resume)
        weights = _best_weights(trainer, model)
    if rr.rank() != 0:
        return None
    return {"weights": weights, "history": history}


def _log_to_this_task() -> None:
    """Lightning's loggers keep the stderr of the task that imported Lightning; a Spark
    Python worker is reused, and that task's relayed stream is closed by now."""
    import logging
    import sys

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning",
                 "lightning_fabric"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr  # not setStream(): it flushes the closed one


def _trainer_args(spec: TrainSpec, pl: Any, history: dict, tmp: str) -> dict:
    """The Trainer's arguments: ringreduce's strategy, this rank's device, the user's
    callbacks (a ModelCheckpoint pointed into the store) and ``trainer_args`` last."""
    import torch

    from ..lightning import for_package

    p = spec.params
    strategy = for_package(spec.payload["package"]).RingreduceStrategy(
        compression=p["gradient_compression"] or _no_compression())
    callbacks = list(p["callbacks"] or [])
    checkpoints = [cb for cb in callbacks if type(cb).__name__ == "ModelCheckpoint"]
    for cb in checkpoints:
        if cb.dirpath is None:
            cb.dirpath = os.path.join(os.path.dirname(spec.checkpoint), "lightning")
    callbacks.append(_epoch_end_class(pl)(spec, history, os.path.join(tmp, "epoch.ckpt")))
    if p["terminate_on_nan"]:
        callbacks.append(_nan_stop_class(pl)())
    gpu = bool(p["use_gpu"]) and torch.cuda.is_available() and p["num_gpus"] != 0
    # _EpochEnd is a Checkpoint callback (run after the module's on_train_epoch_end), so
    # checkpointing is on; with it there, Lightning adds no ModelCheckpoint of its own
    args = {"strategy": strategy, "accelerator": "gpu" if gpu else "cpu", "devices": 1,
            "max_epochs": int(p["epochs"]), "logger": p["logger"] or False,
            "log_every_n_steps": int(p["log_every_n_steps"]), "num_sanity_val_steps": 0,
            "enable_progress_bar": False, "enable_model_summary": False,
            "use_distributed_sampler": False, "enable_checkpointing": True,
            "callbacks": callbacks, "profiler": p["profiler"]}
    return {**args, **(p["trainer_args"] or {})}


def _no_compression() -> Any:
    from ..torch import Compression

    return Compression.none


def _resume_file(spec: TrainSpec, model: Any, saved: Optional[dict], tmp: str
                 ) -> Optional[str]:
    """The run's Lightning checkpoint as a local file (every rank has ``saved``), after
    checking that it is this model's: every rank raises alike."""
    if saved is None:
        return None
    import io

    import torch

    try:
        data = saved["lightning"]  # a TorchEstimator's checkpoint has none
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        model.load_state_dict(state["state_dict"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise mismatched_checkpoint("TorchEstimator (Lightning)", spec, e) from e
    path = os.path.join(tmp, "resume.ckpt")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _best_weights(trainer: Any, model: Any) -> dict:
    """Rank 0's result: the best checkpoint of the user's ModelCheckpoint if there is one
    (Horovod's rule), else the trained module's weights; as numpy arrays."""
    import torch

    state = model.state_dict()
    users = [cb for cb in trainer.callbacks if hasattr(cb, "best_model_path")]
    best = users[0].best_model_path if users else ""
    if best and os.path.exists(best):
        state = torch.load(best, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


class _Batches:
    """A rank's batches as dicts of tensors keyed by column: ``len`` and ``iter`` are all
    Lightning needs of a loader (an iterable, so no sampler is put in)."""

    def __init__(self, spec: TrainSpec, data: RankData, steps: int,
                 batches: Callable[[], Any]) -> None:
        self.spec, self.data, self.steps, self.batches = spec, data, steps, batches

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        p = self.spec.params
        names = [*p["feature_cols"], *p["label_cols"]]
        shapes = list(p["input_shapes"] or [None] * len(p["feature_cols"])) + list(
            p["label_shapes"] or [None] * len(p["label_cols"]))
        weight = p["sample_weight_col"]
        for batch in self.batches():
            out = {n: _tensors([batch[n]], [s] if s else None)[0]
                   for n, s in zip(names, shapes)}
            if weight:
                out[weight] = _tensors([batch[weight]], None)[0]
            yield out


def _loaders(spec: TrainSpec, epoch: Callable[[], int]) -> tuple:
    """(train, val) for ``Trainer.fit``; val is None without validation rows."""
    import ringreduce as rr

    p, rank = spec.params, rr.rank()
    steps, size = spec.steps_per_epoch(rr.size()), int(p["batch_size"])
    data = RankData(spec.train[rank])
    seed = spec.seed() * 1000 + rank
    train = _Batches(spec, data, steps, lambda: data.batches(
        epoch(), steps, size, bool(p["shuffle"]), seed))
    if not spec.val_rows:
        return train, None
    val_data, vsize = RankData(spec.val[rank]), spec.val_batch_size()
    limit = p["validation_steps_per_epoch"]
    count = math.ceil(val_data.rows / vsize)
    val = _Batches(spec, val_data, min(count, limit) if limit else count,
                   lambda: val_data.in_order(vsize, limit))
    return train, val


def _epoch_end_class(pl: Any) -> type:
    class _EpochEnd(pl.callbacks.Checkpoint):
        """The epoch's metrics into the history; rank 0 replaces the run's checkpoint.
        A Checkpoint callback, so Lightning runs it after the module's own
        on_train_epoch_end (whose logged values belong to this epoch's row)."""

        def __init__(self, spec: TrainSpec, history: dict, path: str) -> None:
            self.spec, self.history, self.path = spec, history, path

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            import ringreduce as rr

            row = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if getattr(v, "numel", lambda: 1)() == 1}
            trainer.save_checkpoint(self.path)  # rank 0 writes; every rank waits
            state = {}
            if rr.rank() == 0:
                with open(self.path, "rb") as f:
                    state["lightning"] = f.read()
            end_epoch(rr._comm(), self.spec, trainer.current_epoch, row, self.history, state)

    return _EpochEnd


def _nan_stop_class(pl: Any) -> type:
    class _NanStop(pl.Callback):
        """Horovod's ``terminate_on_nan``: a training loss that is not finite stops the fit
        with an error (the averaged weights make it so on every rank)."""

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               idx: int) -> None:
            import torch

            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
                import ringreduce as rr

                raise InvalidInputError(
                    f"rank {rr.rank()}: TorchEstimator (Lightning): the training loss is "
                    f"{float(loss)} at epoch {trainer.current_epoch}, batch {idx} "
                    "(terminate_on_nan=True)")

    return _NanStop
