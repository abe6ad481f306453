"""Rank-0, atomic Keras model files, and ``load_model`` that resumes every rank alike."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Optional

import keras

from ringreduce import _binder
from ringreduce.checkpoint import atomic_save_path, load_on_root
from ringreduce.compression import Compressor, NoneCompressor

from .optimizer import DistributedOptimizer, is_distributed

__all__ = ["load_model", "save_model"]


def model_suffix(filepath: Any) -> str:
    """The suffix that tells Keras which format to write or read: ``.h5`` (legacy HDF5)
    for ``.h5`` / ``.hdf5`` paths, else ``.keras``. A temporary file must carry it, or
    Keras writes its zip format under an ``.h5`` name."""
    return ".h5" if os.fspath(filepath).lower().endswith((".h5", ".hdf5")) else ".keras"


def save_model(model: keras.Model, filepath: str, root_rank: int = 0, **kwargs: Any) -> bool:
    """``model.save(filepath)`` on ``root_rank`` only, atomically; other ranks return False.

    The file is written under a temporary name beside ``filepath`` (ending in
    ``.keras``, as Keras requires), fsynced and renamed over it. Not collective.

    Parameters
    ----------
    model : keras.Model
        The model (its optimizer's state is saved with it).
    filepath : str
        A ``.keras`` file (or a legacy ``.h5`` one).
    root_rank : int
        The rank that writes.
    **kwargs
        Passed to ``model.save``.
    """
    get = _binder()
    if get().rank() != root_rank:
        return False
    atomic_save_path(filepath, lambda tmp: model.save(tmp, **kwargs), model_suffix(filepath))
    return True


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def load_model(filepath: str, custom_optimizers: Optional[list] = None,
               custom_objects: Optional[dict] = None,
               compression: type[Compressor] = NoneCompressor, root_rank: int = 0,
               **optimizer_kwargs: Any) -> keras.Model:
    """Load a Keras model saved with its optimizer and wrap that optimizer in
    ``DistributedOptimizer`` (Horovod's ``load_model``).

    Collective: ``root_rank`` reads the file and sends it to every rank, so ranks
    whose file system does not have it resume from the same bytes.

    Parameters
    ----------
    filepath : str
        A ``.keras`` file (e.g. written by ``save_model`` or ``callbacks.ModelCheckpoint``).
    custom_optimizers : list of classes, optional
        Optimizer classes to make known to Keras (Horovod's argument).
    custom_objects : dict, optional
        Passed to ``keras.models.load_model``.
    compression : Compressor
        For the wrapped optimizer.
    root_rank : int
        The rank that reads.
    **optimizer_kwargs
        Further ``DistributedOptimizer`` arguments.

    Raises
    ------
    CheckpointError
        On every rank alike, if the root cannot read the file.
    """
    data = load_on_root(_binder()(), filepath, root_rank, _read_bytes)
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    directory = tempfile.mkdtemp(prefix="ringreduce-load-")
    try:
        local = os.path.join(directory, "model" + model_suffix(filepath))
        with open(local, "wb") as f:
            f.write(data)
        model = keras.models.load_model(local, custom_objects=objects)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not is_distributed(opt):
        DistributedOptimizer(opt, compression=compression, **optimizer_kwargs)
    return model
