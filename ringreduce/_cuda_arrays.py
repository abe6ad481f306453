"""GPU arrays into the engine: CuPy arrays, torch CUDA tensors, any DLPack producer on a
CUDA device and any object with ``__cuda_array_interface__``.

A :class:`CudaArray` is what the engine needs of one: device address, shape, dtype code,
device ordinal, the stream that produced it (the GPU executor makes its own stream wait
on that stream with an event before reading), and what keeps the memory alive. Results
of out-of-place calls are allocated by the array's own framework (``torch.empty``,
``cupy.empty``, or a function given to :func:`register_gpu_array_type`), so users get
their own array type back.

Streams: torch tensors are read after ``torch.cuda.current_stream()``'s work at submit
time, CuPy arrays after ``cupy.cuda.get_current_stream()``'s; a DLPack producer is asked
(``__dlpack__(stream=1)``) to order its work before the legacy default stream, which the
executor then waits on; ``__cuda_array_interface__`` v3's ``stream`` is used when given.
A handle's ``wait()`` returns once the result is complete on the device, so it is ready
for every stream.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ._dtypes import (
    BFLOAT16,
    BOOL,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    INT8,
    INT32,
    INT64,
    UINT8,
    dtype_code,
)
from .exceptions import InvalidInputError, call_label

KDL_CUDA, KDL_CUDA_MANAGED = 2, 13
_LEGACY_DEFAULT_STREAM = 1  # DLPack's and CAI's number for CUDA's legacy default stream
_PER_THREAD_DEFAULT_STREAM = 2  # cudaStreamPerThread: the calling thread's default stream

# (DLPack type code, bits) -> the core's dtype code
_DL_DTYPES = {(0, 8): INT8, (0, 32): INT32, (0, 64): INT64, (1, 8): UINT8, (2, 16): FLOAT16,
              (2, 32): FLOAT32, (2, 64): FLOAT64, (4, 16): BFLOAT16, (6, 8): BOOL, (1, 1): BOOL}
TORCH_DTYPES = {"float16": FLOAT16, "bfloat16": BFLOAT16, "float32": FLOAT32,
                 "float64": FLOAT64, "int8": INT8, "int32": INT32, "int64": INT64,
                 "uint8": UINT8, "bool": BOOL}
_ITEMSIZE = {UINT8: 1, INT8: 1, INT32: 4, INT64: 8, FLOAT16: 2, BFLOAT16: 2, FLOAT32: 4,
             FLOAT64: 8, BOOL: 1}


@dataclass
class CudaArray:
    """One GPU array as the engine sees it (C-contiguous by construction)."""

    obj: Any
    ptr: int
    shape: tuple
    code: int
    device: int
    stream: int
    keep: Any
    empty: Optional[Callable[[Any, tuple], Any]]


_ALLOCATORS: dict = {}  # type -> empty(x, shape): an uninitialized array, x's dtype and device


def register_gpu_array_type(cls: type, empty: Callable[[Any, tuple], Any]) -> None:
    """Let out-of-place GPU collectives return arrays of type ``cls``.

    Parameters
    ----------
    cls : type
        A GPU array type exposing ``__dlpack__`` / ``__dlpack_device__`` or
        ``__cuda_array_interface__``.
    empty : callable
        ``empty(x, shape)`` returns a new uninitialized C-contiguous array of ``shape``
        with the dtype and device of ``x`` (torch and CuPy arrays need no registration).
    """
    _ALLOCATORS[cls] = empty


def _torch_empty(x: Any, shape: tuple) -> Any:
    import torch

    return torch.empty(shape, dtype=x.dtype, device=x.device)


def _cupy_empty(x: Any, shape: tuple) -> Any:
    import cupy

    with x.device:
        return cupy.empty(shape, x.dtype)


def ordering_stream(stream: int) -> int:
    """The stream whose work the executor waits for, for work enqueued on ``stream``.

    The executor records its event on the engine thread, where cudaStreamPerThread would
    name that thread's own, empty, default stream: no ordering at all. The legacy default
    stream (0) synchronizes with every blocking stream, the caller's per-thread default
    stream included, so an event recorded there follows the caller's work (and possibly
    more: correct, if conservative).
    """
    return 0 if stream == _PER_THREAD_DEFAULT_STREAM else stream


def _gpu_code(code: int, what: str, dtype: Any) -> int:
    """``code`` if the GPU executor handles it, else InvalidInputError before submitting
    (NCCL has no 16-bit integers; the unsigned wider ones are not wired in the kernels)."""
    if code not in _ITEMSIZE:
        raise _dtype_error(what, str(dtype))
    return code


def is_gpu_array(x: Any) -> bool:
    """True if ``x`` lives in CUDA device memory (cheap for host arrays)."""
    device = getattr(x, "__dlpack_device__", None)
    if device is not None:
        try:
            return int(device()[0]) in (KDL_CUDA, KDL_CUDA_MANAGED)
        except Exception:  # not a usable DLPack producer: the host path says so
            return False
    return hasattr(x, "__cuda_array_interface__")


def cuda_view(x: Any, op: str, name: Optional[str]) -> CudaArray:
    """The :class:`CudaArray` of a GPU array; InvalidInputError if it cannot be used."""
    what = call_label(op, name)
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return _torch_view(x, what)
    if module == "cupy":
        return _cupy_view(x, what)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _dlpack_view(x, what)
    return _cai_view(x, what)


def _torch_view(t: Any, what: str) -> CudaArray:

    code = TORCH_DTYPES.get(str(t.dtype).replace("torch.", ""))
    if code is None:
        raise _dtype_error(what, str(t.dtype))
    if not t.is_contiguous():
        raise _strided_error(what, tuple(t.stride()), tuple(t.shape))
    device = t.get_device()
    stream = ordering_stream(torch_stream_getter()(device))
    return CudaArray(t, int(t.data_ptr()), tuple(t.shape), code, int(device), stream, t,
                     _torch_empty)


@functools.lru_cache(maxsize=1)
def torch_stream_getter() -> Callable[[int], int]:
    """``f(device)``: the handle of torch's current CUDA stream on ``device``, read without
    making a ``torch.cuda.Stream`` object (3 us less per call) where torch allows."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: int(torch.cuda.current_stream(device).cuda_stream)


def _cupy_view(a: Any, what: str) -> CudaArray:
    import cupy

    if not a.flags.c_contiguous:
        raise _strided_error(what, a.strides, a.shape)
    code = _gpu_code(dtype_code(a.dtype, what), what, a.dtype)
    stream = ordering_stream(int(cupy.cuda.get_current_stream().ptr))
    return CudaArray(a, int(a.data.ptr), tuple(a.shape), code, int(a.device.id), stream, a,
                     _cupy_empty)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):  # the head of DLManagedTensor (DLPack 0.x capsules)
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dlpack_view(x: Any, what: str) -> CudaArray:
    # The capsule is read, never consumed: while it is kept (CudaArray.keep), the
    # producer keeps the memory alive, and its destructor releases it afterwards.
    try:
        capsule = x.__dlpack__(stream=_LEGACY_DEFAULT_STREAM)
        t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    except Exception as err:
        raise InvalidInputError(f"{what}: cannot read {type(x).__name__} through DLPack "
                                f"({err})") from err
    code = _DL_DTYPES.get((t.dtype.code, t.dtype.bits))
    if code is None or t.dtype.lanes != 1:
        raise _dtype_error(what, f"DLPack code {t.dtype.code} bits {t.dtype.bits} "
                                 f"lanes {t.dtype.lanes}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] * _ITEMSIZE[code] for i in range(t.ndim))
        _check_contiguous(what, strides, shape, _ITEMSIZE[code])
    return CudaArray(x, int(t.data or 0) + int(t.byte_offset), shape, code,
                     int(x.__dlpack_device__()[1]), 0, capsule, _ALLOCATORS.get(type(x)))


def _cai_view(x: Any, what: str) -> CudaArray:
    cai = x.__cuda_array_interface__
    try:
        dtype = np.dtype(cai["typestr"])
    except TypeError as err:
        raise _dtype_error(what, str(cai["typestr"])) from err
    code = _gpu_code(dtype_code(dtype, what), what, dtype)
    shape = tuple(int(d) for d in cai["shape"])
    if cai.get("strides") is not None:
        _check_contiguous(what, tuple(cai["strides"]), shape, dtype.itemsize)
    stream = cai.get("stream")
    stream = 0 if stream in (None, _LEGACY_DEFAULT_STREAM) else ordering_stream(int(stream))
    device = -1  # the interface does not say; the communicator assumes its GPU
    return CudaArray(x, int(cai["data"][0]), shape, code, device, stream, x,
                     _ALLOCATORS.get(type(x)))


def _check_contiguous(what: str, strides: tuple, shape: tuple, itemsize: int) -> None:
    if 0 in shape:  # no elements: any strides describe them
        return
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            raise _strided_error(what, strides, shape)
        expected *= dim


def _strided_error(what: str, strides: tuple, shape: tuple) -> InvalidInputError:
    return InvalidInputError(f"{what}: GPU collectives need a C-contiguous array, got strides "
                             f"{strides} for shape {shape}; make it contiguous first "
                             "(torch: t.contiguous(), CuPy: cupy.ascontiguousarray(x))")


def _dtype_error(what: str, dtype: str) -> InvalidInputError:
    return InvalidInputError(f"{what}: dtype {dtype} is not supported on GPU; supported are "
                             "uint8, int8, int32, int64, float16, bfloat16, float32, float64, "
                             "bool")
