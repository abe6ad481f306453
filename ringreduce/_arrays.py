"""Array adapter: numpy arrays, DLPack producers and buffer-protocol objects.

Everything becomes a numpy view of the same memory (no copy), so the core sees
only (address, shape, dtype). DLPack is tried before the buffer protocol
because it keeps dtype and shape (e.g. torch CPU tensors).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from . import _core
from .exceptions import InvalidInputError, call_label


def as_array(x: Any, op: str, name: Optional[str] = None) -> np.ndarray:
    """Return a numpy view of ``x`` sharing its memory, or raise InvalidInputError.

    ``op`` and ``name`` only label error messages (built only when one is raised).
    """
    if type(x) is np.ndarray:
        return x
    what = call_label(op, name)
    if isinstance(x, np.ndarray):
        return x
    gpu = _gpu_memory(x)
    if gpu:
        from ._gpu import gpu_array_error

        raise gpu_array_error(what, gpu)
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError) as err:
            raise InvalidInputError(
                f"{what}: cannot view {type(x).__name__} through DLPack ({err}); "
                "GPU arrays need the GPU backend, CPU arrays must be strided in memory"
            ) from err
    if isinstance(x, (np.generic, int, float, bool)):
        return np.asarray(x)
    try:
        return np.asarray(memoryview(x))
    except TypeError as err:
        raise InvalidInputError(
            f"{what}: expected a numpy array, a DLPack tensor or a buffer, "
            f"got {type(x).__name__}"
        ) from err


def _gpu_memory(x: Any) -> str:
    """The kind of GPU memory ``x`` lives in ("CUDA device 0", ...), or "" for host memory."""
    device = getattr(x, "__dlpack_device__", None)
    if device is not None:
        try:
            kind, index = device()
        except Exception:  # not a usable DLPack producer: from_dlpack will say so
            return ""
        from ._gpu import GPU_DLPACK_DEVICES

        name = GPU_DLPACK_DEVICES.get(int(kind))
        return f"{name} device {index}" if name else ""
    return "CUDA" if hasattr(x, "__cuda_array_interface__") else ""


def for_reading(x: Any, op: str, name: Optional[str] = None) -> np.ndarray:
    """A C-contiguous array with the data of ``x`` (copied only if it is strided)."""
    arr = as_array(x, op, name)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def for_writing(x: Any, op: str, name: Optional[str] = None) -> np.ndarray:
    """A writable C-contiguous view of ``x`` for in-place operations."""
    if isinstance(x, (np.generic, int, float, bool)):  # as_array would copy it: a lost result
        raise InvalidInputError(
            f"{call_label(op, name)}: in-place operations need an array, got the immutable "
            f"{type(x).__name__} {x!r}; use the out-of-place form (or np.array(x))")
    arr = as_array(x, op, name)
    flags = arr.flags
    if flags.c_contiguous and flags.writeable:
        return arr
    what = call_label(op, name)
    if not flags.c_contiguous:
        raise InvalidInputError(
            f"{what}: in-place operations need a C-contiguous array, got strides "
            f"{arr.strides} for shape {arr.shape}; use the out-of-place form, or "
            "np.ascontiguousarray(x) and copy the result back"
        )
    if not flags.writeable:
        raise InvalidInputError(f"{what}: the array is read-only; in-place operations write to it")
    return arr


ALIGNMENT = 64  # bytes: what TensorFlow needs to adopt memory without a copy (and SIMD likes)


def empty_aligned(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary.

    Out-of-place results are allocated this way so that frameworks can adopt them
    without copying (TensorFlow copies DLPack memory that is less aligned).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return _core.aligned_bytes(nbytes).view(dtype).reshape(shape)  # ALIGNMENT, in C++


def empty_aligned_like(a: np.ndarray) -> np.ndarray:
    """``empty_aligned(a.shape, a.dtype)``."""
    return empty_aligned(a.shape, a.dtype)
