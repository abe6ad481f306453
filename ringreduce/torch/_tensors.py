"""Plumbing shared by ringreduce.torch: which Communicator to use, torch <-> numpy views.

Tensors cross into the core as numpy views of their memory (no copy): CPU
tensors of numpy's own dtypes through ``Tensor.numpy()``, others through DLPack,
bfloat16 through an int16 view re-labelled as ``ml_dtypes.bfloat16`` (numpy
cannot import bfloat16 through DLPack).

Tests run several ranks as threads of one process; ``use_communicator(comm)``
makes every ringreduce.torch call on the current thread go to ``comm``
instead of the process's default communicator (``ringreduce.init()``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

import ringreduce as _rr
from ringreduce.exceptions import InvalidInputError

# One override mechanism for every framework layer: ringreduce's own.
use_communicator = _rr.use_communicator
comm = _rr._comm


binder = _rr._binder


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
                           torch.int16, torch.int32, torch.int64, torch.bool})


#: torch dtypes the core reduces (the others raise, with torch's way to convert).
_SUPPORTED = frozenset({torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64, torch.bool})


def to_numpy(t: torch.Tensor, what: str) -> np.ndarray:
    """A numpy view of the memory of CPU tensor ``t`` (no copy; strides kept).

    Parameters
    ----------
    t : torch.Tensor
        A CPU tensor; autograd is bypassed (the view is of ``t.detach()``).
    what : str
        Names the call and tensor in error messages.
    """
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    # is_cpu, and detach() only when needed: this runs once per gradient in
    # DistributedOptimizer's hooks (t.device builds an object, detach() a tensor).
    if not t.is_cpu:
        if t.is_cuda:
            from ringreduce._gpu import gpu_array_error

            raise gpu_array_error(what, f"CUDA device {t.device.index}")
        raise InvalidInputError(f"{what}: tensor is on {t.device}; only CPU tensors are "
                                "supported (move it with .cpu())")
    if t.layout != torch.strided:
        raise InvalidInputError(f"{what}: tensor has layout {t.layout}; convert it with "
                                ".to_dense() first")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.dtype not in _SUPPORTED:
        raise InvalidInputError(f"{what}: dtype {t.dtype} is not supported; supported dtypes "
                                "are uint8, int8, int32, int64, float16, bfloat16, float32, "
                                "float64, bool (convert first, e.g. t.to(torch.int32))")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())  # t passed the checks above
    if t.dtype in _NUMPY_NATIVE:
        # The same zero-copy view as DLPack's (strides and offset kept), cheaper
        # (measured, this whole function: 4.1 us per call against 9.6 us through DLPack).
        return t.numpy()
    try:
        return np.from_dlpack(t)
    except (BufferError, RuntimeError, TypeError) as err:
        raise InvalidInputError(f"{what}: cannot view a {t.dtype} tensor as an array ({err}); "
                                "supported dtypes are uint8, int8, int32, int64, float16, "
                                "bfloat16, float32, float64, bool") from err


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing the memory of numpy array ``a`` (bfloat16 included)."""
    if a.dtype.name == "bfloat16":
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
