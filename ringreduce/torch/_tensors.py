"""Plumbing shared by ringreduce.torch: which Communicator to use, torch <-> numpy views.

Tensors cross into the core as numpy views of their memory (no copy): CPU
tensors of numpy's own dtypes through ``Tensor.numpy()``, bfloat16 through an
int16 view re-labelled as ``ml_dtypes.bfloat16`` (numpy has no bfloat16); other
dtypes (complex, float8, ...) are refused with the list of supported ones.

Tests run several ranks as threads of one process; ``use_communicator(comm)``
makes every ringreduce.torch call on the current thread go to ``comm``
instead of the process's default communicator (``ringreduce.init()``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

import ringreduce as _rr
from ringreduce import Communicator
from ringreduce._cuda_arrays import TORCH_DTYPES, torch_stream_getter
from ringreduce._dtypes import SUPPORTED
from ringreduce._gpu_collectives import wait_on_stream
from ringreduce._refusals import reports_refusals
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet

# One override mechanism for every framework layer: ringreduce's own.
use_communicator = _rr.use_communicator


def comm(process_set: Optional[ProcessSet] = None) -> Communicator:
    """The current communicator, or its view of ``process_set`` (InvalidInputError if this
    rank is not a member)."""
    return _rr._on(process_set, "ringreduce.torch")


def refusals(kind: str, group: Optional[str] = None) -> Callable:
    """``reports_refusals`` for a ringreduce.torch collective (see ``ringreduce._refusals``)."""
    return reports_refusals(kind, comm, group=group)


def binder(process_set: Optional[ProcessSet] = None) -> Callable[[], Communicator]:
    """``ringreduce._binder`` for ``process_set``: later calls reach the same set."""
    return _rr._binder(process_set, "ringreduce.torch")


class _ElasticJob:
    """Stands for every communicator of an elastic job in the instance counters."""


_ELASTIC_JOB = _ElasticJob()


def instance_index(table: Any, c: Communicator) -> int:
    """How many objects of a kind (``table``: a WeakKeyDictionary) were made before this one
    on ``c``; it goes into their collectives' names, which must match across ranks.

    In an elastic job the count is the process's over all generations: a worker that joins
    later makes its optimizers in the same order as the others made theirs, while the
    others, after a reset, make none (and one they do make gets a name of its own). Ranks
    as threads (``use_communicator``) count per communicator.
    """
    from ringreduce.elastic import in_elastic_job

    key = _ELASTIC_JOB if in_elastic_job() and _rr._thread.comm is None else c
    index = table.get(key, 0)
    table[key] = index + 1
    return index


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise InvalidInputError(
            "bfloat16 tensors need the ml_dtypes package: pip install ml_dtypes "
            "(or pip install 'ringreduce[torch]')") from err
    return ml_dtypes.bfloat16


#: torch dtypes whose tensors ``Tensor.numpy()`` views directly.
_NUMPY_NATIVE = frozenset({torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                           torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
                           torch.uint64, torch.bool})


def to_numpy(t: torch.Tensor, what: str) -> Any:
    """A numpy view of the memory of CPU tensor ``t`` (no copy; strides kept); a CUDA
    tensor is returned detached as it is: the core takes it as a GPU array
    (ringreduce/_cuda_arrays.py), for the collectives that run on GPU.

    Parameters
    ----------
    t : torch.Tensor
        A CPU or CUDA tensor; autograd is bypassed (the view is of ``t.detach()``).
    what : str
        Names the call and tensor in error messages.
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    # is_cpu, and detach() only when needed: this runs once per gradient in
    # DistributedOptimizer's hooks (t.device builds an object, detach() a tensor).
    if not t.is_cpu:
        if t.is_cuda and t.layout == torch.strided:
            return t.detach()
        raise InvalidInputError(f"{what}: tensor is on {t.device} with layout {t.layout}; CPU "
                                "and strided CUDA tensors are supported (move it with .cpu())")
    if t.layout != torch.strided:
        raise InvalidInputError(f"{what}: tensor has layout {t.layout}; convert it with "
                                ".to_dense() first")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())  # t passed the checks above
    if t.dtype in _NUMPY_NATIVE:
        # The same zero-copy view as DLPack's (strides and offset kept), cheaper
        # (measured, this whole function: 4.1 us per call against 9.6 us through DLPack).
        return t.numpy()
    raise InvalidInputError(f"{what}: {t.dtype} tensors are not supported; supported dtypes "
                            f"are {SUPPORTED} (convert first, e.g. t.to(torch.float32))")


#: torch dtypes the GPU executor reduces, and their core codes (NCCL has no 16-bit ints).
_CUDA_CODES = {getattr(torch, name): code for name, code in TORCH_DTYPES.items()}

_raw_stream = torch_stream_getter()


def current_stream(t: torch.Tensor) -> int:
    """The handle of CUDA tensor ``t``'s device's current stream."""
    return _raw_stream(t.get_device())


def allreduce_cuda_(c: Communicator, t: torch.Tensor, op: int, name: str, prescale: float,
                    postscale: float, compression: Optional[str], stream: int) -> Any:
    """Start an in-place allreduce of CUDA tensor ``t``, produced on ``stream``, on
    ``c``'s GPU path, described here at a few attribute reads (DistributedOptimizer's
    per-gradient path: about 5 us instead of 25 through the general intake); None when
    ``t`` is not a contiguous CUDA tensor of a dtype the GPU reduces (the general path
    then converts or refuses). The caller keeps the handle until it is done or waited
    for with ``wait_cuda_`` (the Communicator does not keep ``t`` alive)."""
    code = _CUDA_CODES.get(t.dtype) if t.is_cuda else None
    if code is None or t.layout != torch.strided or not t.is_contiguous():
        return None
    return c.allreduce_gpu_view_(t, t.data_ptr(), t.shape, code, t.get_device(), stream, op,
                                 name, prescale, postscale, compression, track=False)


def wait_cuda_(handle: Any, t: torch.Tensor, stream: int) -> bool:
    """Wait for ``allreduce_cuda_``'s ``handle`` of ``t``, produced on ``stream``.

    If ``stream`` is still the current one: the way torch DDP waits, ordering that
    stream after the allreduce (work enqueued there next, the optimizer's step, sees its
    result) while the host goes on without waiting for the device; True. ``t`` is
    recorded as in use on the stream the allreduce runs on (``Tensor.record_stream``,
    as torch's NCCL process group does), so its memory is not handed to other work
    before the allreduce is done, whichever stream allocated it; it may be dropped at
    once. Otherwise the host waits for the device, as ``handle.wait()``; False.
    """
    if current_stream(t) != stream:
        handle.wait()
        return False
    used = wait_on_stream(handle, stream)
    if used is not None:
        t.record_stream(_external_stream(used, t.get_device()))
    return True


_EXTERNAL: dict = {}  # (stream handle, device) -> torch.cuda.ExternalStream


def _external_stream(handle: int, device: int) -> Any:
    key = (handle, device)
    s = _EXTERNAL.get(key)
    if s is None:
        s = _EXTERNAL[key] = torch.cuda.ExternalStream(handle, device=device)
    return s


def to_torch(a: Any) -> torch.Tensor:
    """A torch tensor sharing the memory of numpy array ``a`` (bfloat16 included); a torch
    tensor (a GPU collective's result) as it is."""
    if isinstance(a, torch.Tensor):
        return a
    if a.dtype.kind == "V" and a.dtype.name == "bfloat16":  # ml_dtypes' (kind first: cheap)
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)


def check_tensor(t: Any, what: str) -> torch.Tensor:
    """Raise a clear InvalidInputError unless ``t`` is a CPU torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def label(op: str, name: Optional[str]) -> str:
    """``allreduce 'grad.fc.weight'`` or ``allreduce`` for error messages."""
    return f"{op} '{name}'" if name else op
