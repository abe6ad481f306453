"""ringreduce for TensorFlow, with the names of ``horovod.tensorflow``::

    import tensorflow as tf
    import ringreduce.tensorflow as rr     # `import ringreduce.tensorflow as hvd` works too

    rr.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = rr.DistributedGradientTape(tape)          # gradients averaged over ranks
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_step:
        rr.broadcast_variables(model.variables, root_rank=0)
        rr.broadcast_variables(opt.variables, root_rank=0)

Collectives are graph ops (eager, ``tf.function`` and ``tf.compat.v1`` graphs); the
C++ core is not compiled against TensorFlow and tensors reach it without copies
(see ``_bridge``). Keras users import ``ringreduce.keras``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

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
    Product,
    RingReduceError,
    RingReduceTimeoutError,
    Sum,
    _on,
    add_process_set,
    cross_rank,
    cross_size,
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
from ringreduce.compression import Compressor
from ringreduce.process_sets import ProcessSet, global_process_set

from ._bridge import comm as _comm
from ._bridge import current_int, run_translated
from .compression import Compression
from .ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .tf1 import (
    BroadcastGlobalVariablesHook,
    DistributedAdasumTF1Optimizer,
    DistributedTF1Optimizer,
)
from .variables import (
    broadcast_,
    broadcast_global_variables,
    broadcast_variables,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "SyncBatchNormalization",
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "CheckpointError", "Compression",
    "Compressor", "DistributedAdasumTF1Optimizer", "DistributedGradientTape",
    "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "InvalidInputError", "Max", "Min",
    "MismatchError", "NotInitializedError", "PartialDistributedGradientTape", "PeerLostError",
    "Product", "RingReduceError",
    "ProcessSet", "RingReduceTimeoutError", "Sum", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall",
    "barrier", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "global_process_set", "grouped_allgather",
    "grouped_reducescatter", "process_set_included_op", "remove_process_set",
    "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic",
    "is_homogeneous",
    "gloo_built", "gloo_enabled", "grouped_allreduce", "init", "is_initialized", "join",
    "load_checkpoint", "local_rank", "local_rank_op", "local_size", "local_size_op",
    "mpi_built", "rank_op", "size_op", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "rocm_built",
    "run_translated", "save_checkpoint", "shutdown", "size",
    "start_timeline", "stop_timeline", "use_communicator",
]


def __getattr__(name: str) -> Any:
    # ``hvd.elastic`` (Horovod's ``horovod.tensorflow.elastic``), imported on first use;
    # ``hvd.SyncBatchNormalization`` is the Keras 3 layer of ``ringreduce.keras``.
    import importlib

    if name == "elastic":
        return importlib.import_module(".elastic", __name__)
    if name == "SyncBatchNormalization":
        return importlib.import_module("ringreduce.keras.sync_batch_norm").SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def join() -> int:
    """Declare that this rank has no more data; returns the last rank to join.

    Until every rank has joined, this rank takes part in the others' allreduce /
    allgather / broadcast with neutral elements (Average divides by the ranks that
    contributed). Eager only: call it between steps, outside ``tf.function``.
    """
    return _comm().join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank (of ``process_set``) has called ``barrier()``."""
    _on(process_set, "barrier").barrier()


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Any = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank (of ``process_set``; the root
    counted within it). Runs at once, also in a ``tf.compat.v1`` program: ``session`` is
    Horovod's and not needed."""
    return _on(process_set, "broadcast_object").broadcast_object(obj, root_rank, name)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Any = None,
                        process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's TF1 helper: a function ``fn(obj)`` that returns ``root_rank``'s ``obj``
    on every rank (see ``broadcast_object``)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: Any = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Return every rank's picklable ``obj`` as a list in rank order (of ``process_set``);
    ``session`` as for ``broadcast_object``."""
    return _on(process_set, "allgather_object").allgather_object(obj, name)


def DistributedOptimizer(optimizer: Any, name: Any = None, use_locking: bool = False,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap an optimizer so that it applies gradients averaged over all ranks (Horovod's
    signature; with ``process_set``, over its members: other ranks keep their own).

    A ``tf.compat.v1.train.Optimizer`` gets a ``DistributedTF1Optimizer`` (TF1
    graphs), or with ``op=Adasum`` Horovod's delta optimizer
    (``DistributedAdasumTF1Optimizer``: ``compression`` and ``backward_passes_per_step``
    apply, ``sparse_as_dense`` and ``average_aggregated_gradients`` do not); a Keras 3
    optimizer gets ``ringreduce.keras.DistributedOptimizer``, as
    in Horovod. See those for the arguments; ``device_*`` and ``use_locking`` are
    Horovod's and ignored (``use_locking`` is passed to the TF1 base class);
    ``scale_local_gradients`` applies to variables registered with ``register_local_var``.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if not isinstance(op, bool) and op == Adasum:  # Horovod's delta optimizer
            if gradient_predivide_factor != 1.0:
                raise InvalidInputError("DistributedOptimizer: gradient_predivide_factor "
                                        "needs op=Average")
            if process_set.process_set_id != 0:
                raise InvalidInputError("DistributedOptimizer(op=Adasum): Adasum runs over "
                                        "every rank (as in Horovod); leave process_set out")
            return DistributedAdasumTF1Optimizer(optimizer, name, use_locking, compression,
                                                 backward_passes_per_step)
        return DistributedTF1Optimizer(optimizer, name, use_locking, compression,
                                       sparse_as_dense, backward_passes_per_step, op,
                                       gradient_predivide_factor, average_aggregated_gradients,
                                       num_groups, groups, scale_local_gradients, process_set)
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        from ringreduce.keras import DistributedOptimizer as keras_optimizer

        return keras_optimizer(optimizer, name, compression=compression,
                               sparse_as_dense=sparse_as_dense,
                               backward_passes_per_step=backward_passes_per_step, op=op,
                               gradient_predivide_factor=gradient_predivide_factor,
                               average_aggregated_gradients=average_aggregated_gradients,
                               num_groups=num_groups, groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    raise InvalidInputError(f"DistributedOptimizer: expected a tf.compat.v1.train.Optimizer or "
                            f"a keras.optimizers.Optimizer, got {type(optimizer).__name__}")


def _process_set(process_set_id: int, what: str) -> ProcessSet:
    return _comm().process_sets.by_id(process_set_id, what)


def size_op(process_set_id: int = 0, name: Any = None) -> tf.Tensor:
    """Horovod's ``size_op``: ``size()`` (of the process set with that id) as an int32
    tensor (read when a graph runs, in an elastic job)."""
    return current_int(lambda: _process_set(process_set_id, "size_op").size(), name or "size")


def process_set_included_op(process_set_id: int = 0, name: Any = None) -> tf.Tensor:
    """Horovod's: 1 if this rank is a member of the process set with that id, else 0."""
    return current_int(lambda: int(_process_set(process_set_id, "process_set_included_op")
                                   .included()), name or "process_set_included")


def rank_op(name: Any = None) -> tf.Tensor:
    """Horovod's ``rank_op``: ``rank()`` as an int32 tensor."""
    return current_int(lambda: _comm().rank(), name or "rank")


def local_size_op(name: Any = None) -> tf.Tensor:
    """Horovod's ``local_size_op``."""
    return current_int(lambda: _comm().local_size(), name or "local_size")


def local_rank_op(name: Any = None) -> tf.Tensor:
    """Horovod's ``local_rank_op``."""
    return current_int(lambda: _comm().local_rank(), name or "local_rank")


# Horovod's build queries (ringreduce._horovod); this layer hands the engine CPU tensors
# only, so CUDA and NCCL are not built for it.
from ringreduce._horovod import (  # noqa: E402
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rocm_built,
)
from ringreduce._horovod import not_built as cuda_built  # noqa: E402
from ringreduce._horovod import not_built as nccl_built  # noqa: E402
