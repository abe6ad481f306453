"""Shared by the worker scripts: per-rank event logs, the job's shm names, ``run``.

Each event is one JSON line ``{"ev": ..., "t": time.time(), ...}`` appended to
``$RR_TEST_LOG_DIR/rank<r>.log`` (and echoed to stdout), written with a single
``write`` so it is whole even if the process is SIGKILLed right after.
Plain lines (e.g. ``OK rank 0``) go the same way through ``say``. Workers call
``run(main)`` so that a failure exits at once with its traceback on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

_rank: Optional[int] = None


def launch_rank() -> int:
    """This process's rank as the launcher announced it (before init), or 0."""
    if _rank is not None:
        return _rank
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def say(line: str) -> None:
    """Append one line to this rank's log and echo it to stdout."""
    data = (line.rstrip("\n") + "\n").encode()
    log_dir = os.environ.get("RR_TEST_LOG_DIR")
    if log_dir:
        fd = os.open(os.path.join(log_dir, f"rank{launch_rank()}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    sys.stdout.write(data.decode())
    sys.stdout.flush()


def event(ev: str, **fields: Any) -> None:
    """Log a timestamped event."""
    say(json.dumps({"ev": ev, "t": time.time(), "rank": launch_rank(), **fields}))


def error_event(ev: str, err: BaseException) -> None:
    """Log an exception as an event: class, RingReduceError-ness and message."""
    import ringreduce as rr

    event(ev, cls=type(err).__name__, rr=isinstance(err, rr.RingReduceError), msg=str(err))


def watch_job() -> None:
    """Log the job's shared-memory name prefix and this pid once init() discovers the job.

    Segments are named /dev/shm/ringreduce-<first 8 bytes of sha256(secret)>-<rank>
    (csrc/transport/context.cc), so the tests can look for exactly this job's leftovers.
    """
    from ringreduce import _bootstrap

    discover = _bootstrap.discover

    def discover_and_log() -> tuple:
        rank, size, secret, exchange = discover()
        set_rank(rank)
        prefix = "ringreduce-" + hashlib.sha256(secret).digest()[:8].hex() + "-"
        event("job", pid=os.getpid(), size=size, shm_prefix=prefix)
        return rank, size, secret, exchange

    _bootstrap.discover = discover_and_log


def _patch_bootstrap_core(**classes: Any) -> None:
    """Make ringreduce/_bootstrap.py see ``classes`` in place of those of ``_core``."""
    import types

    from ringreduce import _bootstrap

    core = _bootstrap._core
    names = {k: getattr(core, k) for k in dir(core) if not k.startswith("__")}
    _bootstrap._core = types.SimpleNamespace(**{**names, **classes})


def _slow_store_reads(seconds: float) -> None:
    """Act like a rank descheduled for ``seconds`` inside every store allgather.

    Same keys as the core's store_allgather (csrc/rendezvous/store.h): publish
    ``<prefix>/<rank>``, then read every rank's key. Enabled on ranks > 0 by
    RR_TEST_SLOW_STORE_READS=<seconds>.
    """
    from ringreduce import _core

    class SlowClient:
        def __init__(self, host: str, port: int, timeout: float) -> None:
            self._client = _core.TcpStoreClient(host, port, timeout)

        def set(self, key: str, value: bytes) -> None:
            self._client.set(key, value)

        def get(self, key: str, timeout: float) -> bytes:
            return self._client.get(key, timeout)

        def add(self, key: str, value: bytes) -> bytes:
            return self._client.add(key, value)

        def allgather(self, prefix: str, rank: int, size: int, value: bytes,
                      timeout: float) -> list[bytes]:
            self._client.set(f"{prefix}/{rank}", value)
            time.sleep(seconds)
            return [value if r == rank else self._client.get(f"{prefix}/{r}", timeout)
                    for r in range(size)]

    _patch_bootstrap_core(TcpStoreClient=SlowClient)


def run(main: Callable[[], Any], hard_exit: bool = True) -> None:
    """Run ``main``; on an exception print it and leave at once with status 1.

    ``os._exit`` skips interpreter teardown on purpose: under mpirun, mpi4py's
    exit-time MPI_Finalize would wait for ranks that are still busy, and the
    job would hang instead of failing. ``hard_exit=False`` lets an exception
    take the ordinary exit path instead.
    """
    slow = float(os.environ.get("RR_TEST_SLOW_STORE_READS", "0"))
    if slow > 0 and launch_rank() > 0:
        _slow_store_reads(slow)
    if not hard_exit:
        return main()
    try:
        main()
    except BaseException:
        traceback.print_exc()
        event("worker-failed", error=traceback.format_exc(limit=3))
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def engine_cpu_seconds() -> float:
    """CPU time so far of this process's engine threads (named ``rr-engine``; Linux)."""
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "rr-engine":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total
