"""The worker's side of the elastic rendezvous: how ``init()`` learns its rank from the driver.

Under ``ringrun --min-np/--max-np`` (see ``driver.py``) a worker has no fixed rank. Its
environment names the driver (``RINGREDUCE_ELASTIC_DRIVER=host:port``), the worker's
identity (``RINGREDUCE_ELASTIC_WORKER``) and the job secret (``RINGREDUCE_SECRET``, the
connection's HMAC key). The worker keeps one authenticated connection
(``multiprocessing.connection``) for its life and sends one request at a time:

* ``("join", worker, wants_sync)``: answered once the driver has formed the next
  generation with this worker in it: ``("assign", generation, rank, size, secret,
  sync)``, where ``sync`` says whether every member runs ``state.sync()`` (one answer for
  all: true when a member is new to the job or asked for it); ``("leave", why)`` when the
  worker's host was removed or training ended (the worker exits 0); or ``("fail", why)``.
* ``("exchange", worker, generation, record)``: answered with every member's endpoint
  record in rank order once all have sent theirs, or ``("retry", why)`` if a member died
  first (``init()`` raises PeerLostError; ``elastic.run`` rejoins).
* ``("updates", worker, generation)``: ``("updates", changed, removed_only)``: whether the
  driver wants a new generation since this one was formed (hosts added or removed).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Client
from typing import Any, Optional

from ..exceptions import InvalidInputError, PeerLostError, RingReduceError

DRIVER_VAR = "RINGREDUCE_ELASTIC_DRIVER"
WORKER_VAR = "RINGREDUCE_ELASTIC_WORKER"


class Membership:
    """This process's place in the elastic job: the generation it last joined."""

    generation: Optional[int] = None
    rank: Optional[int] = None  # in that generation
    wants_sync = True  # sent with the next join: this rank's retry loop wants a sync
    sync = True  # the driver's answer for the generation: every member syncs, or none


def in_elastic_job() -> bool:
    """True when an elastic driver (``ringrun --min-np ...``) started this process."""
    return DRIVER_VAR in os.environ


def _address() -> tuple[str, int]:
    host, _, port = os.environ[DRIVER_VAR].rpartition(":")
    if not host or not port.isdigit():
        raise InvalidInputError(f"{DRIVER_VAR}={os.environ[DRIVER_VAR]!r} is not host:port")
    return host, int(port)


class _Link:
    """This process's one authenticated connection to the driver, made on first use (a
    handshake per request would cost a few round trips each commit)."""

    conn: Any = None
    lock = threading.Lock()


def ask(request: tuple, timeout: Optional[float] = None) -> tuple:
    """Send ``request`` to the driver and return its answer (PeerLostError if it is gone).

    Without ``timeout`` the answer may take as long as the driver needs (a new worker
    waits for the running generation's next commit); the driver bounds that itself, and
    TCP keepalive finds a driver whose host is gone.
    """
    where = os.environ[DRIVER_VAR]
    with _Link.lock:
        try:
            if _Link.conn is None:
                key = os.environ.get("RINGREDUCE_SECRET", "").encode()
                _Link.conn = Client(_address(), authkey=key)
                tune(_Link.conn.fileno())
            conn = _Link.conn
            conn.send(request)
            deadline = None if timeout is None else time.monotonic() + timeout
            while not conn.poll(1.0):
                if deadline is not None and time.monotonic() > deadline:
                    _drop()
                    raise PeerLostError(f"elastic worker {worker_id()}: the driver at {where} "
                                        f"did not answer {request[0]!r} within {timeout:g} s")
            return conn.recv()
        except (OSError, EOFError) as err:
            _drop()
            raise PeerLostError(f"elastic worker {worker_id()}: lost the driver at {where} "
                                f"during {request[0]!r}: {err}") from err


def _drop() -> None:
    conn, _Link.conn = _Link.conn, None
    if conn is not None:
        conn.close()


def forget() -> None:
    """Leave no trace of an elastic job in this process (its connection, its place), for
    a process that runs another job later: a Spark Python worker that Spark reuses."""
    _drop()
    Membership.generation = Membership.rank = None
    Membership.wants_sync = Membership.sync = True


def tune(fd: int) -> None:
    """No Nagle delay (requests are small and answered at once); keepalive probes an idle
    connection every 5 s after 10 s and gives up after 3 missed probes."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass  # not TCP (or not Linux): the driver's own bounds still hold
    finally:
        sock.close()


def worker_id() -> str:
    return os.environ.get(WORKER_VAR, "?")


def join() -> tuple[int, int, int, bytes]:
    """Wait for the next generation; return (generation, rank, size, secret)."""
    answer = ask(("join", worker_id(), Membership.wants_sync))
    if answer[0] == "assign":
        _, generation, rank, size, secret, sync = answer
        Membership.generation, Membership.rank, Membership.sync = generation, rank, sync
        return generation, rank, size, secret
    if answer[0] == "leave":
        print(f"ringreduce: elastic worker {worker_id()} leaves the job: {answer[1]}",
              file=sys.stderr, flush=True)
        raise SystemExit(0)
    raise RingReduceError(f"elastic worker {worker_id()}: the driver ended the job: {answer[1]}")


def exchange(generation: int, rank: int, record: bytes) -> list[bytes]:
    """Allgather the endpoint records of ``generation`` through the driver."""
    answer = ask(("exchange", worker_id(), generation, record))
    if answer[0] == "infos":
        return list(answer[1])
    raise PeerLostError(f"elastic rank {rank} (worker {worker_id()}): generation {generation} "
                        f"broke up during the rendezvous: {answer[1]}")


def host_updates() -> tuple[bool, bool]:
    """(changed, removed_only): whether the driver wants a new generation."""
    if Membership.generation is None:
        return False, False
    answer: Any = ask(("updates", worker_id(), Membership.generation), timeout=30)
    return bool(answer[1]), bool(answer[2])


def discover() -> tuple[int, int, bytes, Any]:
    """``_bootstrap.discover`` for an elastic worker: (rank, size, secret, exchange)."""
    generation, rank, size, secret = join()
    return rank, size, secret, lambda mine: exchange(generation, rank, mine)
