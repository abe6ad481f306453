"""Spark ML persistence of the estimators' fitted models: ``model.write().save(path)``,
``TorchModel.load(path)`` / ``KerasModel.load(path)``, and so ``PipelineModel.save`` and
``PipelineModel.load`` of a pipeline that holds one.

A saved model is a directory: ``metadata/`` as Spark ML writes it for any Python stage
(its class, uid and JSON-able params; ``PipelineModel.load`` finds the class there) and
``ringreduce/model.pkl``, written atomically: the framework's model as bytes
(``torch.save`` of the module, or a ``.keras`` file) and the other params (columns,
history, run_id, ...). Like the store, the path must be a local or mounted one.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from ..checkpoint import atomic_write
from .common.store import _local_path

_PAYLOAD = os.path.join("ringreduce", "model.pkl")


class ModelWriter(MLWriter):
    """Writes a fitted model (``ModelBase.write()``)."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        from pyspark import cloudpickle

        model = self.instance
        params = {n: model.getOrDefault(n) for n in model._DEFAULTS if n != "model"}
        # cloudpickle, as Spark ships them to fit: a lambda in custom_objects saves too.
        # Everything is serialized before anything is written, and the metadata (which
        # makes the directory a saved stage) last, so a failure leaves no half-saved model.
        data = cloudpickle.dumps({"model": model._model_to_bytes(), "params": params},
                                 protocol=4)
        target = os.path.join(_local_path(path), _PAYLOAD)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic_write(target, lambda f: f.write(data))
        DefaultParamsWriter.saveMetadata(model, path, self.sparkSession, paramMap={})


class ModelReader(MLReader):
    """Reads what ``ModelWriter`` wrote, as an instance of ``cls``."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        with open(os.path.join(_local_path(path), _PAYLOAD), "rb") as f:
            payload = pickle.load(f)
        params = {k: v for k, v in payload["params"].items() if v is not None}
        model = self.cls(**params)
        model._set(model=self.cls._model_from_bytes(payload["model"], params))
        model._resetUid(metadata["uid"])
        return model
