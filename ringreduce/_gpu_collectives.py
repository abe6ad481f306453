"""The collectives of one Communicator on GPU arrays (``_cuda_arrays``): allreduce (fused
and grouped, in place or not), broadcast, reducescatter, allgather and alltoall go to the
engine's GPU executor (NCCL on the device; emulated over host memory with
``RINGREDUCE_GPU_EMULATE=1``). One GPU per process: the first GPU array fixes this rank's
device, and an array on another device is refused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from . import _core
from ._cuda_arrays import CudaArray, cuda_view, ordering_stream
from ._gpu import cuda_device_count
from .exceptions import InvalidInputError, call_label

ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER, ALLTOALL = 1, 2, 3, 4, 5  # CollKind (op_header.h)
FLOAT16, BFLOAT16, FLOAT32, FLOAT64 = 4, 5, 6, 7  # DType (dtype.h)
# compression= -> the wire dtype's code (None / "none": no compression)
WIRES = {"fp16": FLOAT16, "float16": FLOAT16, "bf16": BFLOAT16, "bfloat16": BFLOAT16}


def wire_code(compression: Optional[str], views: Sequence[CudaArray], what: str) -> int:
    """The dtype code an allreduce of ``views`` travels as with ``compression``: -1 (none)
    for None / "none", and for arrays that are not float32 / float64 (Horovod's policy:
    only floats wider than the wire type are cast)."""
    if compression is None or compression == "none":
        return -1
    code = WIRES.get(compression) if isinstance(compression, str) else None
    if code is None:
        raise InvalidInputError(f"{what}: compression must be None, 'fp16' or 'bf16'; got "
                                f"{compression!r}")
    return code if views and views[0].code in (FLOAT32, FLOAT64) else -1


def wait_on_stream(handle: Any, stream: int) -> Optional[int]:
    """A stream-ordered wait for ``handle`` (from ``GpuCollectives.allreduce_view_``).

    Returns once its GPU work is enqueued, with ``stream`` (a CUDA stream handle of the
    calling thread's; 0: the legacy default stream of the handle's device) made to wait
    for that work, so work the caller enqueues there next runs after it; the host does
    not wait for the device. Returns the handle of the stream the work runs on (for
    ``Tensor.record_stream``), or None when the handle was already done (it then raises
    its failure, as ``wait()`` would). A failure after the work was enqueued is raised
    by the next call instead (as with torch DDP); the engine then aborts the work, so a
    stream waiting for it goes on.
    """
    return _core.gpu.wait_stream(handle, stream)


class GpuCollectives:
    """Submits GPU arrays to ``engine``; results are the arrays' own type.

    Parameters
    ----------
    engine : ringreduce._core.Engine
        The communicator's engine.
    rank : int
        This rank, for messages.
    members : list of int, optional
        A process set's ranks: its collectives run on an NCCL communicator of those ranks
        only (made at the set's first GPU collective). None: the whole job.
    """

    def __init__(self, engine: Any, rank: int, members: Optional[list[int]] = None) -> None:
        self._engine = engine
        self._rank = rank
        self._members = list(members or [])
        self._device: Optional[int] = None

    def join_device(self, local_rank: int) -> int:
        """The GPU this rank takes part on in GPU collectives once it has joined: the one
        its GPU calls used, else GPU ``local_rank`` (mod the visible GPUs: one process
        per GPU, as with Horovod)."""
        if self._device is not None:
            return self._device
        count = cuda_device_count()
        return local_rank % count if count else local_rank

    def views(self, xs: Sequence[Any], op: str, name: Optional[str]) -> list[CudaArray]:
        """The arrays as CudaArrays on this rank's GPU, with one dtype."""
        what = call_label(op, name)
        views = [cuda_view(x, op, name) for x in xs]
        for v in views:
            if v.device < 0:  # __cuda_array_interface__ alone does not say
                v.device = self._device if self._device is not None else 0
            self._claim(v.device, what)
        if len({v.code for v in views}) > 1:
            raise InvalidInputError(f"{what}: the GPU arrays of one group must share a dtype")
        return views

    def _claim(self, device: int, what: str) -> None:
        """Fix this rank's GPU at its first GPU array; InvalidInputError for another one."""
        if self._device is None:
            self._device = device
        elif device != self._device:
            raise InvalidInputError(
                f"{what}: the array is on CUDA device {device}, but this rank's GPU "
                f"collectives run on device {self._device} (one GPU per process: "
                "torch.cuda.set_device(rr.local_rank()) / "
                "cupy.cuda.Device(rr.local_rank()).use())")

    def allreduce_view_(self, x: Any, ptr: int, shape: Sequence[int], code: int, device: int,
                        stream: int, name: str, op: int, pre: float, post: float,
                        wire: int) -> Any:
        """An in-place allreduce of GPU array ``x`` that the caller has described (C-contiguous
        at ``ptr``, ``shape``, dtype ``code`` on ``device``, produced on ``stream``); a
        handle whose ``wait()`` returns ``x``. A framework layer's per-gradient path."""
        if device != self._device:
            self._claim(device, call_label("allreduce_", name))
        return _core.gpu.allreduce_(self._engine, x, ptr, shape, code, name, device,
                                    ordering_stream(stream), op, pre, post, self._members,
                                    wire)

    def results(self, views: list[CudaArray], op: str, name: Optional[str],
                shapes: Optional[list[tuple]] = None) -> list[CudaArray]:
        """New arrays like ``views`` (of ``shapes``, else theirs), allocated by their own
        framework on their device."""
        out = []
        for i, v in enumerate(views):
            if v.empty is None:
                raise InvalidInputError(
                    f"{call_label(op, name)}: ringreduce cannot allocate a result like a "
                    f"{type(v.obj).__name__}; use an in-place form, or "
                    "ringreduce.register_gpu_array_type(type, empty)")
            out.append(cuda_view(v.empty(v.obj, shapes[i] if shapes else v.shape), op, name))
        return out

    def submit(self, kind: int, ins: list[CudaArray], outs: Optional[list[CudaArray]],
               names: list[str], group: str = "", op: int = 0, pre: float = 1.0,
               post: float = 1.0, root: int = -1, splits: Sequence[int] = (),
               peer_rows: Sequence[int] = (), wire: int = -1) -> Any:
        """One engine submission of ``ins`` (``outs`` None: in place); its core handle.
        Allgather / alltoall: ``peer_rows`` are the rows coming from each rank, ``splits``
        alltoall's rows going to each. Allreduce: ``wire`` is the dtype code the data
        travels as (compression; -1: its own)."""
        return _core.gpu.submit(
            self._engine, kind, [v.ptr for v in ins], [v.ptr for v in outs] if outs else
            [0] * len(ins), [list(v.shape) for v in ins], ins[0].code, names, group,
            ins[0].device, ins[0].stream, op, pre, post, root, list(splits), list(peer_rows),
            self._members, wire)
