"""Elastic training state and the retry loop, written once for every framework layer.

Protocol of ``run_fn`` (Horovod's ``hvd.elastic.run``), per attempt:

1. ``state.sync()`` (unless the last interrupt said only hosts were removed): rank 0's
   committed state goes to every rank, so workers that just joined start from it;
2. ``func(state)``; its return value ends the loop;
3. a lost or silent peer (PeerLostError, RingReduceTimeoutError, also when a framework
   wrapped it): ``state.restore()`` rolls back to the last ``commit()``, since the failed
   step may have half-applied;
   ``HostsUpdatedInterrupt`` (raised by ``commit()`` on every rank at once): no rollback;
4. ``reset()``: leave the job (``shutdown()``) and ``init()`` again, which blocks in the
   driver until the next generation is formed; then ``state.on_reset()`` runs the user's
   reset callbacks (e.g. scaling the learning rate to the new size), and back to 1.

Invariants: every rank of a generation runs the same sequence of collectives from the
same ``commit()`` point (``commit`` agrees on host updates by a broadcast from rank 0,
so all raise or none does); rank 0 of a new generation is always a worker that was in
the previous one (the driver orders ranks by age), so ``sync()`` never spreads a fresh
worker's initial state. Errors that are the program's own (a mismatch, bad input) are
not retried: they would fail again the same way.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Callable, Optional

import numpy as np

from .. import _wrapped_errors
from ..exceptions import (
    HostsUpdatedInterrupt,
    PeerLostError,
    RingReduceError,
    RingReduceTimeoutError,
)
from . import _client

__all__ = ["ObjectState", "State", "run_fn"]

RECOVERABLE = (PeerLostError, RingReduceTimeoutError)


def _default_bcast(obj: Any) -> Any:
    import ringreduce as rr

    return rr.broadcast_object(obj, 0, name="elastic.state")


def _default_rank() -> int:
    import ringreduce as rr

    return rr.rank()


class State:
    """State kept in memory across workers joining and leaving (Horovod's ``State``).

    Subclasses implement ``save`` (copy the live state to memory), ``restore`` (copy the
    saved state back) and ``sync`` (rank 0's state to every rank).

    Parameters
    ----------
    bcast_object : callable, optional
        ``obj -> rank 0's obj``; default ``ringreduce.broadcast_object`` from rank 0.
    get_rank : callable, optional
        This worker's current rank; default ``ringreduce.rank``.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        self._bcast_object = bcast_object or _default_bcast
        self._rank = get_rank or _default_rank
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], Any]]) -> None:
        """Functions to call after every reset (workers added or removed), in order.

        Parameters
        ----------
        callbacks : list of callable
            E.g. one that scales the learning rate with the new ``size()``.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (called by ``run`` after a new generation formed)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state to memory, then raise ``HostsUpdatedInterrupt`` on every rank if
        the driver has added or removed hosts (collective: call it at the same step on
        every rank). Commit as often as losing the steps since the last commit is
        acceptable; each commit copies the state."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when hosts were added or removed.

        Rank 0 asks the driver; its answer is broadcast, so every rank raises or none does.
        """
        answer = _client.host_updates() if self._rank() == 0 else None
        changed, removed_only = self._bcast_object(answer) or (False, False)
        if changed:
            raise HostsUpdatedInterrupt(skip_sync=removed_only)

    def save(self) -> None:
        """Copy the live state to memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved state, undoing uncommitted changes."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError


class ObjectState(State):
    """State of plain picklable Python values, each given as a keyword and kept as an
    attribute (``state.epoch``, ``state.batch``...).

    Parameters
    ----------
    bcast_object, get_rank : callable, optional
        As for ``State``.
    **kwargs :
        The values; ``save`` deep-copies them, so a list changed after a commit is
        restored as it was at the commit.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def save(self) -> None:
        self._saved_state = {k: _copy_over(self._saved_state[k], getattr(self, k))
                             for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _copy_over(old: Any, new: Any) -> Any:
    """A deep copy of ``new``; a numpy array goes into ``old``'s memory when it fits (a
    fresh 100 MB copy at every commit spent most of its time faulting in new pages)."""
    if isinstance(new, np.ndarray) and isinstance(old, np.ndarray) and old is not new and \
            old.shape == new.shape and old.dtype == new.dtype and old.flags.writeable and \
            type(old) is np.ndarray and type(new) is np.ndarray:
        np.copyto(old, new)
        return old
    return copy.deepcopy(new)


def recoverable(err: BaseException) -> bool:
    """Whether ``err`` is a lost or silent peer (also wrapped by a framework)."""
    if isinstance(err, RECOVERABLE):
        return True
    if isinstance(err, RingReduceError):
        return False
    found = _wrapped_errors.find(str(err))
    return isinstance(found, RECOVERABLE)


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` in the elastic retry loop (see the module docstring).

    Parameters
    ----------
    func : callable
        The training function; its first argument is a ``State``.
    reset : callable
        Leaves the job and joins its next generation (the framework's shutdown + init).

    Returns
    -------
    callable
        ``wrapper(state, *args, **kwargs)``, returning ``func``'s value.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync, resets = False, 0
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as err:
                skip_sync = err.skip_sync
                why = "hosts were " + ("removed" if err.skip_sync else "added or removed")
            except Exception as err:
                if not (recoverable(err) and _client.in_elastic_job()):
                    raise
                state.restore()
                skip_sync, why = False, f"{type(err).__name__}: {err}"
            resets += 1
            print(f"ringreduce: elastic worker {_client.worker_id()}: reset {resets} "
                  f"({why})", file=sys.stderr, flush=True)
            # Whether to sync is the driver's one answer for the whole generation: ranks
            # that saw the interrupt and ranks that lost a peer during the same commit
            # would otherwise disagree, and a replacement ringrun started always syncs.
            _client.Membership.wants_sync = not skip_sync
            reset()
            state.on_reset()
            skip_sync = not _client.Membership.sync

    return wrapper
