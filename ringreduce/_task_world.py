"""Ranks made of workers that another system started: Spark's barrier tasks
(``ringreduce.spark``) and Ray's actors (``ringreduce.ray``). Written once for both.

How a world forms (the protocol each adapter follows):
  1. Every worker describes itself (``describe``): its host identity (the one that decides
     shared memory, ``_bootstrap.host_id``), an address the others reach it at, and a
     port free on it right now.
  2. The descriptions reach every worker (Spark: ``BarrierTaskContext.allGather``; Ray:
     through the driver), the same list everywhere, indexed by the other system's order.
  3. Each worker computes the same rank order (``rank_order``): workers grouped by host,
     hosts in the order of their first worker, as Horovod and ``ringrun`` place ranks, so a
     host's ranks are consecutive; rank 0's address and port are the rendezvous.
  4. ``world_env`` is the env-var launch (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) plus
     a secret the driver made for this world, so two worlds on one port refuse each other.
  5. ``call`` runs the user's function, which calls ``init()`` as under ``ringrun``. A
     function that raises leaves the job at once (``shutdown()``), so its peers' waits end
     in ``PeerLostError`` within seconds instead of a stall; the record carries the error.
  6. ``returned`` gives the values in rank order, or raises the root failure again: the
     earliest error that is not a lost peer (the others are its echo), with the failing
     rank's traceback as ``__cause__``.
Invariant: every worker derives its rank from the same list, so no two workers claim one
rank; the bootstrap's claim check (``_bootstrap._claim``) still refuses one that would.
"""

from __future__ import annotations

import os
import pickle
import secrets
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Union

from .exceptions import PeerLostError, RingReduceError


class _RemoteTraceback(Exception):
    """Carries a rank's traceback text as the ``__cause__`` of the re-raised error."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Worker:
    """One worker as the others see it."""

    host: str      # host identity: equal ones share memory
    address: str   # reachable by the other workers
    port: int      # free on ``address`` when described; the rendezvous if this is rank 0


def describe(address: str) -> Worker:
    """This process as a worker reached at ``address``."""
    from ._bootstrap import host_id
    from .launcher import _free_port

    return Worker(host_id(), address, _free_port())


def new_secret() -> str:
    """A secret for one world (``RINGREDUCE_SECRET``)."""
    return secrets.token_hex(32)


def rank_order(workers: Sequence[Worker]) -> list[int]:
    """Indices of ``workers`` in rank order: grouped by host, hosts by first appearance."""
    hosts: dict[str, list[int]] = {}
    for i, w in enumerate(workers):
        hosts.setdefault(w.host, []).append(i)
    return [i for group in hosts.values() for i in group]


def world_env(workers: Sequence[Worker], index: int, secret: str,
              extra: Optional[Mapping[str, str]] = None,
              order: Optional[Sequence[int]] = None) -> dict[str, str]:
    """The launch variables of worker ``index`` (its rank, its host's ranks, rank 0's
    address and port), then ``extra``. ``order`` (indices of ``workers`` in rank order)
    is ``rank_order(workers)`` unless the other system fixed the ranks already."""
    order = rank_order(workers) if order is None else order
    me, root = workers[index], workers[order[0]]
    here = [i for i in order if workers[i].host == me.host]
    return {"RANK": str(order.index(index)), "WORLD_SIZE": str(len(workers)),
            "LOCAL_RANK": str(here.index(index)), "LOCAL_WORLD_SIZE": str(len(here)),
            "MASTER_ADDR": root.address, "MASTER_PORT": str(root.port),
            "RINGREDUCE_SECRET": secret, **(extra or {})}


def forwarded_env(base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The driver's ``RINGREDUCE_*`` and ``HOROVOD_*`` settings, which the workers get as
    ``ringrun`` gives them to remote ranks (launch variables excluded)."""
    from .launcher import _scrubbed_env, settings_only

    return settings_only(_scrubbed_env(os.environ if base is None else base))


def driver_env(start_timeout: Optional[float], nics: Union[None, str, Sequence[str]],
               env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Every worker's settings from the driver: ``forwarded_env()``, then Horovod's
    ``start_timeout`` and ``nics`` (one interface: a list of several is refused, as by
    ``ringrun --network-interfaces``), then the user's ``env``."""
    from ._horovodrun import run_env

    nic = nics if nics is None or isinstance(nics, str) else ",".join(nics)
    return {**forwarded_env(), **run_env(start_timeout, nic),
            **{k: str(v) for k, v in (env or {}).items()}}


def set_environ(env: Mapping[str, str]) -> dict[str, Optional[str]]:
    """Set ``env`` in ``os.environ``; return what to give ``restore_environ`` after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return saved


def restore_environ(saved: Mapping[str, Optional[str]]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def call(fn: Callable[..., Any], args: Sequence[Any] = (),
         kwargs: Optional[Mapping[str, Any]] = None) -> dict:
    """``fn(*args, **kwargs)`` as a record: ``{"ok": True, "value": ...}`` or the error
    (pickled when it can be, its text and traceback). On an error this process leaves the
    job, so peers waiting for it raise ``PeerLostError`` instead of waiting."""
    try:
        return {"ok": True, "value": fn(*args, **dict(kwargs or {}))}
    except Exception as e:
        record = error_record(e)
        from . import shutdown

        shutdown()
        return record


def error_record(e: BaseException) -> dict:
    """A failed call's record (call it inside the ``except`` block)."""
    text = traceback.format_exc()
    try:
        error: Optional[bytes] = pickle.dumps(e)
        pickle.loads(error)
    except Exception:
        error = None
    return {"ok": False, "error": error, "text": f"{type(e).__name__}: {e}",
            "traceback": text, "at": time.time(), "peer_lost": isinstance(e, PeerLostError)}


def exit_record(e: SystemExit) -> dict:
    """The record of a call that raised SystemExit: an elastic worker the driver told to
    leave (code 0: ``left``, no value), or a function that exited."""
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return {"ok": code == 0, "value": None, "left": True, "code": code, "error": None,
            "text": f"SystemExit({e.code!r})", "traceback": "", "at": time.time()}


def elastic_call(fn: Callable[..., Any], args: Sequence[Any] = (),
                 kwargs: Optional[Mapping[str, Any]] = None) -> dict:
    """One elastic worker's life in a process another system started (a Ray actor, a Spark
    task): ``call``'s record, or ``exit_record`` for a worker the driver told to leave,
    with the rank and generation it ended in. The process then leaves the job and forgets
    it (Spark reuses its Python workers)."""
    from . import shutdown
    from .elastic import _client

    try:
        record = call(fn, args, kwargs)
    except SystemExit as e:
        record = exit_record(e)
    finally:
        shutdown()
    record = {**record, "rank": _client.Membership.rank,
              "generation": _client.Membership.generation}
    _client.forget()
    return record


def reraise(record: Mapping[str, Any], who: str) -> NoReturn:
    """Raise a failed record's error again (a RingReduceError if it did not pickle), with
    its traceback text, headed by ``who``, as ``__cause__``."""
    cause = _RemoteTraceback(f"\n\n{who} raised:\n{record['traceback']}")
    err = None
    if record["error"] is not None:
        try:
            err = pickle.loads(record["error"])
        except Exception:
            err = None
    if not isinstance(err, BaseException):
        err = RingReduceError(f"{who} raised {record['text']}")
    raise err from cause


def returned(records: Sequence[Optional[Mapping[str, Any]]], what: str) -> list:
    """The values of ``records`` (one per rank, in rank order), or the root failure raised
    again (see the module's protocol); ``what`` names the caller in errors. A driver that
    raises as soon as one rank failed gives None for the ranks it did not wait for."""
    failed = [(r, rec) for r, rec in enumerate(records) if rec is not None and not rec["ok"]]
    if failed:
        rank, rec = min(failed, key=lambda f: (f[1].get("peer_lost", False),
                                              f[1].get("at", 0.0)))
        reraise(rec, f"{what}: rank {rank}")
    if any(rec is None for rec in records):
        raise RingReduceError(f"{what}: a rank's record is missing and none failed")
    return [rec["value"] for rec in records]  # type: ignore[index]


def last_generation(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of an elastic job's last generation (each carries the ``generation``
    its worker ended in, None for one that joined none); when no worker joined one,
    every record."""
    def gen(r: Mapping[str, Any]) -> int:
        return -1 if r["generation"] is None else r["generation"]

    last = max((gen(r) for r in records), default=-1)
    return [r for r in records if gen(r) == last]


def elastic_values(what: str, records: Sequence[Mapping[str, Any]], code: int,
                   failure: Optional[str]) -> list:
    """What an elastic job run by ``elastic.driver`` in this process gives back: the values
    of its last generation's ranks in rank order; or that generation's root failure raised
    again; or RingReduceError with the driver's reason (``failure``, exit ``code``)."""
    last = last_generation(records)
    failed = [r for r in last if not r["ok"]]
    if failed:
        first = min(failed, key=lambda r: (r.get("peer_lost", False), r.get("at", 0.0)))
        reraise(first, f"{what}: rank {first['rank']}")
    if failure or code != 0:
        why = failure or (f"stopped by signal {code - 128}" if code > 128 else
                          "a worker failed after training finished")
        raise RingReduceError(f"{what}: the job ended (exit code {code}): {why}")
    by_rank = {r["rank"]: r["value"] for r in last if not r.get("left")}
    if not by_rank or sorted(by_rank) != list(range(len(by_rank))):
        raise RingReduceError(f"{what}: the last generation's ranks returned no values "
                              f"(ranks {sorted(by_rank)})")
    return [by_rank[r] for r in range(len(by_rank))]


def lost(what: str, rank: int, why: str) -> RingReduceError:
    """The error for a rank whose worker ended without a record (it died)."""
    return RingReduceError(f"{what}: rank {rank}'s worker ended without a result: {why}")
