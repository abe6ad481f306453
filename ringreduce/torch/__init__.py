"""ringreduce for PyTorch, with the names of ``horovod.torch``::

    import torch
    import ringreduce.torch as rr          # `import ringreduce.torch as hvd` works too

    rr.init()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * rr.size())
    opt = rr.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    rr.broadcast_parameters(model.state_dict(), root_rank=0)
    rr.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:                    # shard the data by rr.rank() / rr.size()
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    rr.save_checkpoint("ckpt.pt", model=model, optimizer=opt, epoch=e)   # rank 0, atomic

Tensors cross into the C++ core as views of their memory (DLPack, no copy);
the extension is not compiled against torch. CPU tensors only for now.
"""

from __future__ import annotations

from ringreduce import (
    Adasum,
    Average,
    Communicator,
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
    add_process_set,
    barrier,
    cross_rank,
    cross_size,
    cuda_built,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    nccl_built,
    rank,
    reduce_isa,
    remove_process_set,
    run,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    use_communicator,
)
from ringreduce.checkpoint import CheckpointError

from . import elastic
from ._tensors import comm as _comm
from .broadcast import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .checkpoint import load_checkpoint, save_checkpoint
from .compression import Compression, Compressor
from .grouped import (
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_reducescatter,
    grouped_reducescatter_async,
)
from .movement import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    reducescatter,
    reducescatter_async,
)
from .ops import (
    Handle,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    shared_zeros,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "CheckpointError", "Communicator", "Compression", "Compressor",
    "DistributedOptimizer", "Handle", "elastic", "HorovodInternalError", "HostsUpdatedInterrupt",
    "InvalidInputError", "Max", "Min", "MismatchError",
    "NotInitializedError", "PeerLostError", "Product", "RingReduceError",
    "RingReduceTimeoutError", "Sum", "SyncBatchNorm", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "ccl_built", "cuda_built", "ddl_built",
    "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rocm_built", "broadcast_optimizer_state",
    "broadcast_parameters", "cross_rank", "cross_size", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "init",
    "is_homogeneous",
    "is_initialized", "join", "load_checkpoint", "local_rank", "local_size", "poll", "rank",
    "reduce_isa", "reducescatter", "reducescatter_async", "save_checkpoint", "shared_zeros",
    "sparse_allreduce_async", "run", "shutdown", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set",
    "size", "start_timeline", "stop_timeline", "synchronize", "use_communicator",
]


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Declare that this rank has no more data; returns the last rank to join.

    Until every rank has joined, this rank takes part in the other ranks'
    allreduce / allgather / broadcast (e.g. DistributedOptimizer's gradient
    allreduces) with neutral elements; Average divides by the ranks that
    contributed. ``device`` is Horovod's (where to allocate the zeros) and is
    ignored: the engine provides them itself. With ``process_set`` only that set's
    members join, and only its collectives take neutral elements from them; the rank
    returned is then the global rank of the set's last member to join (as in Horovod).
    A rank that joined the global set takes part with neutral elements in every set.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise InvalidInputError(f"join: device must be an int, got {device!r}")
    return _comm(process_set).join()


# Horovod's build queries (ringreduce._horovod); CUDA tensors run through NCCL when this
# build has CUDA (cuda_built) and libnccl.so.2 can be loaded (nccl_built).
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
