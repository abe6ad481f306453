"""Gradient compression for TensorFlow tensors (Horovod's ``hvd.Compression``).

The policy (cast floats wider than the wire type, and back after the allreduce) is
``ringreduce.compression``'s, shared with ringreduce.torch; this module supplies
TensorFlow's dtype queries and ``tf.cast``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ringreduce.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TFCast(CastCompressor):
    @staticmethod
    def dtype_of(tensor: Any) -> tf.DType:
        """``tensor.dtype``."""
        return tensor.dtype

    @staticmethod
    def is_float(dtype: tf.DType) -> bool:
        """``dtype.is_floating``."""
        return dtype.is_floating

    @staticmethod
    def itemsize(dtype: tf.DType) -> int:
        """``dtype.size``."""
        return dtype.size

    @staticmethod
    def cast(tensor: Any, dtype: tf.DType) -> tf.Tensor:
        """``tf.cast(tensor, dtype)``."""
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFCast):
    """Send float32/float64 tensors as float16 (halves the bytes; 11-bit mantissa, max 65504)."""

    wire = tf.float16


class BF16Compressor(_TFCast):
    """Send float32/float64 tensors as bfloat16 (float32's range, 8-bit mantissa)."""

    wire = tf.bfloat16


class Compression:
    """The built-in compressors: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
