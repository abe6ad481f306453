"""Calls refused on one rank, told to the others (every framework layer uses this).

A collective that one rank refuses before submitting it (a bad dtype, op, root or
device, found by the framework adapter's own checks) would leave the other ranks
waiting for it forever. The Communicator reports the refusals its own checks find
(``Communicator._refuse``: rank 0 hears of it and the other ranks' calls of that name
raise at once, naming this rank and the error). ``reports_refusals`` extends that to
an adapter's public functions: an ``InvalidInputError`` escaping one is reported once
(an error carries a mark once reported, so nested calls do not report it twice; a
second report of an unnamed call would skip the next call's name and put the ranks
out of step).

Only single-collective calls take the decorator: a composite call (an object
broadcast, a sparse allreduce) may fail after its first collective went through,
and the others would then be told of the wrong one.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, Union

from .exceptions import InvalidInputError, RingReduceError

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_ringreduce_reported"


def is_reported(err: BaseException) -> bool:
    """Whether the other ranks have been told of ``err`` already."""
    return getattr(err, _MARK, False)


def mark_reported(err: BaseException) -> None:
    """Record that the other ranks have been told of ``err``."""
    setattr(err, _MARK, True)


def name_rank(err: BaseException, rank: Union[int, str]) -> str:
    """Start ``err``'s message with ``rank <rank>: `` (as the engine's own errors do), unless
    it names a rank already; return the message. ``rank`` may be a label (a process set
    member: its job rank and its rank in the set)."""
    if err.args and isinstance(err.args[0], str) and not err.args[0].startswith("rank "):
        err.args = (f"rank {rank}: {err.args[0]}",) + err.args[1:]
    return str(err)


def reports_refusals(kind: str, comm_of: Callable[[Any], Any],
                     eager: Optional[Callable[[], bool]] = None,
                     group: Optional[str] = None) -> Callable[[F], F]:
    """Decorate a public collective of a framework layer so that a refusal reaches the
    other ranks.

    Parameters
    ----------
    kind : str
        The collective's engine name: ``allreduce``, ``allgather``, ``broadcast``,
        ``reducescatter`` or ``alltoall``.
    comm_of : callable
        The communicator for the call's ``process_set`` argument (``None`` when the
        function has none); its own errors (not initialized, not a member) mean there is
        nobody to tell.
    eager : callable, optional
        Whether a refusal now is a refusal of a collective now (TensorFlow: not while a
        graph is traced, whose collectives run later, when the graph runs).
    group : str, optional
        For a grouped allreduce: the argument holding its tensors (each member is refused).
    """

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except InvalidInputError as err:
                if not is_reported(err) and (eager is None or eager()):
                    _report(kind, comm_of, group, sig.bind_partial(*args, **kwargs).arguments,
                            err)
                raise

        return call  # type: ignore[return-value]

    return decorate


def _report(kind: str, comm_of: Callable[[Any], Any], group: Optional[str], bound: dict,
            err: InvalidInputError) -> None:
    try:
        comm = comm_of(bound.get("process_set"))
    except RingReduceError:  # not initialized, not a member: nobody waits for this call
        return
    if group is None:
        comm._refuse(kind, bound.get("name"), err)
    else:
        comm._refuse_group(bound.get("name"), bound.get(group), err)
