"""Gradient compression for JAX arrays (Horovod's ``hvd.Compression``).

The policy (cast floats wider than the wire type, and back after the allreduce) is
``ringreduce.compression``'s, shared with the torch and TensorFlow layers; this module
supplies JAX's dtype queries and ``astype``, which trace inside ``jax.jit``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ringreduce.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _JaxCast(CastCompressor):
    @staticmethod
    def dtype_of(tensor: Any) -> np.dtype:
        """``tensor.dtype``."""
        return np.dtype(tensor.dtype)

    @staticmethod
    def is_float(dtype: np.dtype) -> bool:
        """Whether ``dtype`` is a floating-point type (bfloat16 included)."""
        return bool(jnp.issubdtype(dtype, jnp.floating))

    @staticmethod
    def itemsize(dtype: Any) -> int:
        """Bytes per element."""
        return np.dtype(dtype).itemsize

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        """``tensor.astype(dtype)``."""
        return tensor.astype(dtype)


class FP16Compressor(_JaxCast):
    """Send float32/float64 arrays as float16 (halves the bytes; 11-bit mantissa, max 65504)."""

    wire = jnp.float16


class BF16Compressor(_JaxCast):
    """Send float32/float64 arrays as bfloat16 (float32's range, 8-bit mantissa)."""

    wire = jnp.bfloat16


class Compression:
    """The built-in compressors: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
