"""Gradient compression, written once for every framework: send floats as fp16 or bf16.

Horovod's interface: ``compress(tensor) -> (compressed, ctx)`` before the allreduce
and ``decompress(tensor, ctx)`` after it. The policy is the same everywhere: only
floating-point tensors wider than the wire type are cast; integers and floats that
are already narrow pass through unchanged. A framework layer subclasses
``CastCompressor`` with four one-line hooks (its dtype, cast and type queries) and
exposes ``Compression.none / .fp16 / .bf16``.

On GPU arrays the cast need not be a framework op: a compressor that keeps
``CastCompressor``'s ``compress`` / ``decompress`` and names its wire type in
``wire_name`` (``'fp16'`` / ``'bf16'``) lets the framework layer pass the float32 /
float64 tensor itself with ``compression=wire_name``; the GPU executor then casts in its
fusion pack and unpack kernels and NCCL reduces the half-precision buffer
(``device_compression``).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["CastCompressor", "Compressor", "NoneCompressor"]


class Compressor:
    """Interface of a gradient compressor (subclass it for your own)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and a context for ``decompress``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return the reduced tensor in the caller's representation."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return ``tensor`` itself and no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return ``tensor`` itself."""
        return tensor


class CastCompressor(Compressor):
    """Cast floating-point tensors wider than ``wire`` to it, and back afterwards.

    Framework layers set ``wire`` and implement the hooks below.
    """

    wire: Any = None
    wire_name: str = ""  # "fp16" / "bf16": the GPU executor can cast to ``wire`` itself

    @staticmethod
    def dtype_of(tensor: Any) -> Any:
        """The tensor's dtype (framework hook)."""
        raise NotImplementedError

    @staticmethod
    def is_float(dtype: Any) -> bool:
        """Whether ``dtype`` is a floating-point type (framework hook)."""
        raise NotImplementedError

    @staticmethod
    def itemsize(dtype: Any) -> int:
        """Bytes per element of ``dtype`` (framework hook)."""
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        """``tensor`` converted to ``dtype`` (framework hook)."""
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        """Cast floating-point tensors wider than the wire type; keep the original dtype."""
        dtype = cls.dtype_of(tensor)
        if cls.is_float(dtype) and cls.itemsize(dtype) > cls.itemsize(cls.wire):
            return cls.cast(tensor, cls.wire), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        """Cast back to the dtype ``compress`` saw (if it cast at all)."""
        return tensor if ctx is None else cls.cast(tensor, ctx)

    @classmethod
    def device_compression(cls) -> Optional[str]:
        """``wire_name`` when the GPU executor may do this compressor's casts (its
        ``compress`` / ``decompress`` are ``CastCompressor``'s own), else None."""
        own = (cls.compress.__func__ is CastCompressor.compress.__func__
               and cls.decompress.__func__ is CastCompressor.decompress.__func__)
        return (cls.wire_name or None) if own else None
