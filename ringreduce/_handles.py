"""Handles of collectives in flight, as the Python layer returns them."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional


def _oldest_done(q: deque) -> bool:
    """Whether the oldest handle kept alive is done (False if another thread's
    release_done() emptied the deque meanwhile: appends take no lock)."""
    try:
        return q[0].done()
    except IndexError:
        return False


class Handle:
    """A collective in flight. Pass it to ``synchronize()`` or ``poll()``.

    Holds the input and output arrays alive until the collective completes. (An in-place
    allreduce of a plain numpy array returns a ``ringreduce._core.ArrayHandle`` instead: the
    same ``wait()`` and ``done()``, made in C++ because it is the per-gradient hot path.)
    """

    __slots__ = ("_core", "_finish", "_keep", "_result")

    def __init__(self, core: Any, finish: Callable[[Any], Any], keep: tuple = ()) -> None:
        self._core = core
        self._finish: Optional[Callable[[Any], Any]] = finish
        self._keep = keep
        self._result: Any = None

    def done(self) -> bool:
        """True once the collective has completed (successfully or not)."""
        return self._core.done()

    def wait(self) -> Any:
        """Block until complete (the GIL is released) and return the result; raises on error."""
        if self._finish is not None:
            self._core.wait()
            finish, self._finish = self._finish, None
            self._result = finish(self._core)
            self._keep = ()
        return self._result


class _HandleGroup:
    """Several handles waited on as one (the grouped allgather and reducescatter)."""

    __slots__ = ("_handles", "results")

    def __init__(self, handles: list) -> None:
        self._handles = handles
        self.results: list = []

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> None:
        """Wait for every member, even after one failed, then raise the first error."""
        results, first = [], None
        for h in self._handles:
            try:
                results.append(h.wait())
            except Exception as err:
                first = first or err
        if first is not None:
            raise first
        self.results = results
