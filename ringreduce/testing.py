"""Run N ranks as N threads in one process, over the real transports.

Used by the threaded test tier; also handy for trying collectives without a
launcher::

    from ringreduce.testing import run_threaded
    results = run_threaded(4, lambda comm: comm.allreduce(np.ones(3)))
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

from . import _core
from ._communicator import Communicator


def make_world(size: int, host_ids: Optional[Sequence[str]] = None,
               rank_env: Optional[Sequence[dict]] = None) -> list[Communicator]:
    """Create ``size`` connected communicators in this process.

    Parameters
    ----------
    size : int
        Number of ranks.
    host_ids : sequence of str, optional
        Host identity per rank; ranks with different ids talk over TCP,
        equal ids over shared memory (unless RINGREDUCE_TRANSPORT says otherwise).
    rank_env : sequence of dict, optional
        Environment variables set while each rank's context and engine are made (each
        rank reads its own settings, as separate processes would).
    """
    secret = os.urandom(32)
    ids = list(host_ids) if host_ids is not None else ["threads"] * size
    envs = list(rank_env) if rank_env is not None else [{}] * size
    contexts = []
    for r in range(size):
        with environ(envs[r]):
            contexts.append(_core.Context(r, size, secret, ids[r]))
    infos = [c.local_info() for c in contexts]
    errors: list[BaseException] = []

    def connect(c: Any) -> None:
        try:
            c.connect(infos)
        except BaseException as err:  # reported below, in the caller's thread
            errors.append(err)

    threads = [threading.Thread(target=connect, args=(c,)) for c in contexts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    comms = []
    for r, c in enumerate(contexts):
        with environ(envs[r]):
            comms.append(Communicator(c))
    return comms


@contextlib.contextmanager
def environ(values: dict) -> Iterator[None]:
    """Set environment variables for the ``with`` block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_threaded(size: int, fn: Callable[[Communicator], Any],
                 world: Optional[list[Communicator]] = None, timeout: float = 120.0,
                 return_exceptions: bool = False) -> list[Any]:
    """Run ``fn(comm)`` on every rank concurrently; return results in rank order.

    The first exception raised by any rank is re-raised (after all threads end or
    ``timeout`` passes, whichever is first), unless ``return_exceptions`` is true:
    then each failing rank's exception takes the place of its result.
    """
    comms = world if world is not None else make_world(size)
    results: list[Any] = [None] * size
    errors: list[Optional[BaseException]] = [None] * size

    def body(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except BaseException as err:
            errors[r] = err

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"threaded ranks did not finish within {timeout} s")
    if world is None:
        for c in comms:
            c.close()
    for r, err in enumerate(errors):
        if err is not None and not return_exceptions:
            raise err
        if err is not None:
            results[r] = err
    return results
