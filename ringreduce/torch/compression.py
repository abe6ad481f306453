"""Gradient compression for allreduce: send floating-point tensors as fp16 or bf16.

Same interface as Horovod's: ``compress(tensor) -> (compressed, ctx)`` before the
allreduce and ``decompress(tensor, ctx)`` after it. Custom compressors subclass
``Compressor``. Only floating-point tensors wider than the wire type are cast;
integers and already-narrow floats pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface of a gradient compressor (subclass it for your own)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and a context for ``decompress``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the reduced tensor in the caller's representation."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``tensor`` itself and no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return ``tensor`` itself."""
        return tensor


class _CastCompressor(Compressor):
    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Cast floating-point tensors wider than the wire type; keep the original dtype."""
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype.itemsize > cls.wire.itemsize:
            return tensor.to(cls.wire), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast back to the dtype ``compress`` saw (if it cast at all)."""
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send float32/float64 tensors as float16 (halves the bytes; 11-bit mantissa, max 65504)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Send float32/float64 tensors as bfloat16 (float32's range, 8-bit mantissa)."""

    wire = torch.bfloat16


class Compression:
    """The built-in compressors: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
