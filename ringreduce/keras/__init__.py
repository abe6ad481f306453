"""ringreduce for Keras 3, with the names of ``horovod.tensorflow.keras`` / ``horovod.keras``::

    import keras
    import ringreduce.keras as rr          # `import ringreduce.keras as hvd` works too

    rr.init()
    opt = rr.DistributedOptimizer(keras.optimizers.Adam(1e-3 * rr.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[rr.callbacks.BroadcastGlobalVariablesCallback(0),
                               rr.callbacks.MetricAverageCallback(),
                               rr.callbacks.LearningRateWarmupCallback(initial_lr=...,
                                                                       warmup_epochs=2),
                               rr.callbacks.ModelCheckpoint("ckpt.keras")],  # rank 0 writes
              verbose=1 if rr.rank() == 0 else 0)

Backends: TensorFlow (the one Horovod supported), torch and JAX; see ``optimizer``.
"""

from __future__ import annotations

import importlib
from typing import Any

import keras

from ringreduce import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidInputError,
    Max,
    Min,
    MismatchError,
    NotInitializedError,
    PeerLostError,
    ProcessSet,
    Product,
    RingReduceError,
    RingReduceTimeoutError,
    Sum,
    _binder,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    use_communicator,
)
from ringreduce.checkpoint import CheckpointError

from . import callbacks, elastic
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .saving import load_model, save_model
from .sync_batch_norm import SyncBatchNormalization

if keras.backend.backend() == "tensorflow":
    from ringreduce.tensorflow import (
        Compression,
        allgather,
        allreduce,
        alltoall,
        broadcast,
        broadcast_variables,
        ccl_built,
        cuda_built,
        ddl_built,
        gloo_built,
        gloo_enabled,
        grouped_allreduce,
        mpi_built,
        mpi_enabled,
        mpi_threads_supported,
        nccl_built,
        reducescatter,
        rocm_built,
    )
else:  # ringreduce.jax's or ringreduce.torch's collectives and compressors
    _layer = importlib.import_module("ringreduce.jax" if keras.backend.backend() == "jax"
                                     else "ringreduce.torch")
    Compression = _layer.Compression
    allgather, allreduce, alltoall = _layer.allgather, _layer.allreduce, _layer.alltoall
    broadcast, reducescatter = _layer.broadcast, _layer.reducescatter
    grouped_allreduce = _layer.grouped_allreduce
    from ringreduce import cuda_built, nccl_built
    from ringreduce._horovod import (
        ccl_built,
        ddl_built,
        gloo_built,
        gloo_enabled,
        mpi_built,
        mpi_enabled,
        mpi_threads_supported,
        rocm_built,
    )

    def broadcast_variables(variables: Any, root_rank: int = 0,
                            process_set: ProcessSet = global_process_set) -> None:
        """Overwrite Keras ``variables`` with ``root_rank``'s values (eager; with
        ``process_set``, among its members, the root counted within it)."""
        comm = _binder(process_set, "ringreduce.keras")()
        callbacks.broadcast_keras_variables(comm, list(variables),
                                            comm._check_root(root_rank, "broadcast_variables"),
                                            "broadcast_variables")

__all__ = [
    "SyncBatchNormalization",
    "Adasum", "Average", "CheckpointError", "Compression", "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "InvalidInputError",
    "Max", "Min", "MismatchError", "NotInitializedError", "PeerLostError", "ProcessSet",
    "Product", "add_process_set", "ccl_built", "cuda_built", "ddl_built", "global_process_set",
    "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "remove_process_set", "rocm_built",
    "RingReduceError", "RingReduceTimeoutError", "Sum", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_global_variables",
    "broadcast_object", "broadcast_variables", "callbacks", "cross_rank", "cross_size", "elastic",
    "is_homogeneous",
    "grouped_allreduce", "init", "is_initialized", "join", "load_model", "local_rank",
    "local_size", "rank", "reducescatter", "save_model", "shutdown", "size",
    "start_timeline", "stop_timeline",
    "use_communicator",
]


def join() -> int:
    """Declare that this rank has no more data; returns the last rank to join."""
    return _binder()().join()


def barrier() -> None:
    """Wait until every rank has called ``barrier()``."""
    _binder()().barrier()


def broadcast_object(obj: Any, root_rank: int = 0, name: Any = None) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank."""
    return _binder()().broadcast_object(obj, root_rank, name)


def allgather_object(obj: Any, name: Any = None) -> list:
    """Return every rank's picklable ``obj`` as a list in rank order."""
    return _binder()().allgather_object(obj, name)


def broadcast_global_variables(root_rank: int, model: Any = None) -> None:
    """Horovod's ``hvd.broadcast_global_variables`` for Keras: broadcast ``model``'s
    variables and its optimizer's from ``root_rank`` (any backend; eager)."""
    if model is None:
        raise InvalidInputError("broadcast_global_variables: Keras 3 has no global variables; "
                                "pass the model (or use callbacks."
                                "BroadcastGlobalVariablesCallback)")
    variables = list(model.variables)
    opt = getattr(model, "optimizer", None)
    if opt is not None and opt.built:
        variables += list(opt.variables)
    callbacks.broadcast_keras_variables(_binder()(), variables, root_rank,
                                        "broadcast_global_variables")
