"""Gradient compression for torch tensors: send floating-point tensors as fp16 or bf16.

Same interface as Horovod's: ``compress(tensor) -> (compressed, ctx)`` before the
allreduce and ``decompress(tensor, ctx)`` after it. Custom compressors subclass
``Compressor``. The policy (only floats wider than the wire type are cast) is
``ringreduce.compression``'s, shared with the TensorFlow layer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ringreduce.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


def device_compression(compression: Any, tensor: torch.Tensor) -> Optional[str]:
    """``'fp16'`` / ``'bf16'`` when ``tensor`` is on CUDA and ``compression`` is a built-in
    cast (or a subclass keeping its casts): the GPU executor then casts float32 / float64
    in its fusion kernels (other dtypes travel as they are, the same policy). None: cast
    with ``compression.compress`` / ``decompress`` as on the CPU."""
    if not tensor.is_cuda or not isinstance(compression, type) or not issubclass(
            compression, CastCompressor):
        return None
    return compression.device_compression()


class _TorchCast(CastCompressor):
    @staticmethod
    def dtype_of(tensor: torch.Tensor) -> torch.dtype:
        """``tensor.dtype``."""
        return tensor.dtype

    @staticmethod
    def is_float(dtype: torch.dtype) -> bool:
        """``dtype.is_floating_point``."""
        return dtype.is_floating_point

    @staticmethod
    def itemsize(dtype: torch.dtype) -> int:
        """``dtype.itemsize``."""
        return dtype.itemsize

    @staticmethod
    def cast(tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
        """``tensor.to(dtype)``."""
        return tensor.to(dtype)


class FP16Compressor(_TorchCast):
    """Send float32/float64 tensors as float16 (halves the bytes; 11-bit mantissa, max 65504)."""

    wire = torch.float16
    wire_name = "fp16"


class BF16Compressor(_TorchCast):
    """Send float32/float64 tensors as bfloat16 (float32's range, 8-bit mantissa)."""

    wire = torch.bfloat16
    wire_name = "bf16"


class Compression:
    """The built-in compressors: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
