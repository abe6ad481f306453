"""Framework-neutral state agreement: used by every framework layer alike.

* ``agree``: a collective check that every rank holds the same signature (names,
  shapes, dtypes of a model or an optimizer), raising the same error everywhere.
* ``split_skeleton`` / ``join_skeleton``: a nested state (dicts, lists, tuples) with
  its tensors replaced by picklable ``Slot`` placeholders, so the skeleton travels
  with ``broadcast_object`` and the tensors with one broadcast each.
* ``wait_all``: wait for every handle even after one failed, then raise the first error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

from .exceptions import InvalidInputError, RingReduceError

__all__ = ["Slot", "agree", "collect_slots", "join_skeleton", "split_skeleton", "wait_all"]


def wait_all(handles: Iterable[Any]) -> list:
    """Wait for every handle (even after one failed), then raise the first error.

    Parameters
    ----------
    handles : iterable
        Objects with a ``wait()`` method.

    Returns
    -------
    list
        Their results, in order.
    """
    results, first = [], None
    for h in handles:
        try:
            results.append(h.wait())
        except RingReduceError as err:
            first = first or err
            results.append(None)
    if first is not None:
        raise first
    return results


def agree(comm: Any, what: str, signature: Any, describe: str = "") -> None:
    """Raise the same InvalidInputError on every rank unless ``signature`` is equal everywhere.

    Collective.

    Parameters
    ----------
    comm : Communicator
        The ranks that must agree.
    what : str
        The calling operation, for the message and the collective's name.
    signature : picklable
        A summary such as ``[(name, (shape, dtype)), ...]``.
    describe : str
        Appended to "ranks disagree" in the message.
    """
    everyone = comm.allgather_object(signature, name=f"{what}.signature")
    if all(s == everyone[0] for s in everyone):
        return
    lines = [f"rank {r} has {_diff(everyone[0], s)} compared to rank 0"
             for r, s in enumerate(everyone) if s != everyone[0]]
    raise InvalidInputError(f"{what}: ranks disagree{describe}: " + "; ".join(lines) +
                            ". Every rank must build the same model and optimizer.")


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, list) and isinstance(b, list):
        try:
            da, db = dict(a), dict(b)
        except (TypeError, ValueError):
            return f"{len(b)} entries instead of {len(a)}" if len(a) != len(b) else \
                "different entries"
        extra = sorted(set(db) - set(da))[:5]
        missing = sorted(set(da) - set(db))[:5]
        changed = sorted(k for k in set(da) & set(db) if da[k] != db[k])[:5]
        parts = [f"extra {extra}" if extra else "", f"missing {missing}" if missing else "",
                 ", ".join(f"{k!r}: {db[k]} instead of {da[k]}" for k in changed)]
        return "; ".join(p for p in parts if p) or "a different order"
    return f"{b!r} instead of {a!r}"


class Slot:
    """Stands for the i-th tensor of a nested state while its skeleton is pickled."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple, dtype: Any) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype

    def __getstate__(self) -> tuple:
        return self.index, self.shape, self.dtype

    def __setstate__(self, state: tuple) -> None:
        self.index, self.shape, self.dtype = state


def split_skeleton(obj: Any, tensors: list, is_tensor: Callable[[Any], bool],
                   describe: Callable[[Any], tuple]) -> Any:
    """Replace the tensors in ``obj`` (dicts, lists, tuples) by Slots, appending them to
    ``tensors``; ``describe(t)`` gives a Slot's ``(shape, dtype)``."""
    if is_tensor(obj):
        tensors.append(obj)
        return Slot(len(tensors) - 1, *describe(obj))
    if isinstance(obj, dict):
        return {k: split_skeleton(v, tensors, is_tensor, describe) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(split_skeleton(v, tensors, is_tensor, describe) for v in obj)
    return obj


def join_skeleton(obj: Any, tensors: list) -> Any:
    """The inverse of ``split_skeleton``: Slots replaced by ``tensors[slot.index]``."""
    if isinstance(obj, Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: join_skeleton(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(join_skeleton(v, tensors) for v in obj)
    return obj


def collect_slots(obj: Any) -> list:
    """The Slots of a skeleton, sorted by index."""
    out: list = []
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, Slot):
            out.append(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
    return sorted(out, key=lambda s: s.index)
