"""Warm memory for large out-of-place results (``allreduce(x)``, ``broadcast(x)``).

Why: a fresh result of many megabytes costs about as much as the collective's own
memory traffic, because the kernel must fault in and zero every page of it (huge
pages included) on its first write, and in a ring those faults stall every rank.
Training loops ask for results of the same sizes every step, so the pages of a
result the user has dropped are kept and handed out again.

Protocol. ``take(nbytes)`` returns a writable 64-byte-aligned uint8 array. Arrays of
at least ``min_bytes`` come from blocks sized in 64 KiB steps: the result's ``base``
is a ``memoryview`` of the block, which the result and every view of it (numpy
views, torch/TensorFlow tensors adopted through DLPack) keep alive, so its finalizer
runs exactly when the last reference to any part of the result is gone; it then puts
the block back on the free list of its size.
Invariants: a block is on a free list only when no array refers to its memory; the
blocks on free lists total at most ``capacity`` bytes (beyond that a returned block
is released); the lock is reentrant because a finalizer can run in any thread, also
while that thread is inside ``take``.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from ._arrays import ALIGNMENT, empty_aligned

_STEP = 64 << 10


class OutputPool:
    """Free lists of warm blocks, keyed by size.

    Parameters
    ----------
    capacity : int
        Most bytes kept on the free lists (0: nothing is kept).
    min_bytes : int
        Smaller results are plain allocations (malloc reuses small blocks anyway).
    """

    def __init__(self, capacity: int, min_bytes: int = 256 << 10) -> None:
        self._capacity = capacity
        self._min = min_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.RLock()
        self.reused = 0  # results served from a free list (a statistic for tests)

    @property
    def min_bytes(self) -> int:
        """Results smaller than this are plain allocations."""
        return self._min

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, 64-byte-aligned uint8 array of ``nbytes`` (contents undefined)."""
        if nbytes < self._min or self._capacity <= 0:
            return empty_aligned((nbytes,), np.uint8)
        size = -(-(nbytes + ALIGNMENT) // _STEP) * _STEP
        raw = None
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                raw = blocks.pop()
                self._kept -= size
                self.reused += 1
        if raw is None:
            raw = np.empty(size, np.uint8)
        start = -raw.ctypes.data % ALIGNMENT
        out = np.frombuffer(memoryview(raw[start:start + nbytes]), np.uint8)
        # out.base is the memoryview numpy made (not the one passed in, which dies
        # here): out and every view of it keep that one alive.
        weakref.finalize(out.base, self._give_back, raw, size)
        return out

    def _give_back(self, raw: np.ndarray, size: int) -> None:
        with self._lock:
            if self._kept + size <= self._capacity:
                self._free.setdefault(size, []).append(raw)
                self._kept += size

    def empty_like(self, a: np.ndarray) -> np.ndarray:
        """An uninitialised C-contiguous array of ``a``'s shape and dtype, 64-byte aligned."""
        return self.take(a.nbytes).view(a.dtype).reshape(a.shape)
