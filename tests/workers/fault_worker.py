"""Fault injection: one rank (the victim) fails at a chosen point, the others report.

    python fault_worker.py --scenario SCENARIO [--victim V] [--sync-dir D]

Scenarios for the victim:

* ``during``: SIGKILL itself from a thread while a ``--mb`` (64) MB allreduce
  is running (the survivors loop on it, or make one call with ``--once``);
* ``idle``: sleep, then SIGKILL itself while the others wait in an allreduce;
* ``init``: SIGKILL itself right after init(), before any collective (the
  survivors make their first call ``--delay`` s later, when it is surely dead);
* ``leave``: call rr.shutdown() while the others wait, then stay alive a while;
* ``raise``: raise a Python exception after init() and exit the normal way
  (interpreter teardown, atexit handlers, mpi4py's MPI_Finalize).

The survivors run allreduces until one fails and log it as a ``raised`` event
(class, message, time), then log what their next collective did
(``next-raised``), then wait until every survivor got that far (files in
``--sync-dir``, up to ``--linger`` seconds) so that nobody's exit is mistaken
for the fault. The victim logs ``killing`` just before it dies.

Other scenarios (all ranks take part, nobody dies):

* ``mismatch``: rank r allreduces ``--sizes[r]`` elements, expects MismatchError
  on every rank, then a correct allreduce must work;
* ``join``: init() and a barrier; logs ``joined`` or ``raised``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
from workerlib import error_event, event, run, say, set_rank, watch_job

import ringreduce as rr

KILLS = ("during", "idle", "init")


def die() -> None:
    event("killing", pid=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def survive(args: argparse.Namespace) -> None:
    """Loop on allreduces until one fails; log it and what the next collective does."""
    buf = np.ones(args.mb << 18 if args.scenario == "during" else 1000, np.float32)
    if args.scenario == "during":
        rr.barrier(name="start")  # the victim's clock starts here too
    if args.scenario == "init":
        time.sleep(args.delay)
    done = 0
    try:
        while True:
            rr.allreduce_(buf, op=rr.Average, name="victim-watch")
            done += 1
            if args.once or (args.scenario != "during" and done > 1000):
                raise AssertionError(f"{done} allreduce(s) succeeded although a rank is gone")
    except rr.RingReduceError as err:
        error_event("raised", err)
    event("completed", allreduces=done)
    try:
        rr.allreduce(np.ones(4, np.float32), name="after-failure")
        event("next-ok")
    except Exception as err:
        error_event("next-raised", err)
    (Path(args.sync_dir) / f"survivor-{rr.rank()}").touch()
    linger(args, rr.size())


def linger(args: argparse.Namespace, size: int) -> None:
    """Stay alive until every survivor has reported (or ``--linger`` s passed)."""
    deadline = time.monotonic() + args.linger
    while time.monotonic() < deadline:
        if len(list(Path(args.sync_dir).glob("survivor-*"))) >= size - 1:
            return
        time.sleep(0.05)
    event("linger-timeout")


def victim(args: argparse.Namespace) -> None:
    if args.scenario == "init":
        die()
    elif args.scenario == "during":
        buf = np.ones(args.mb << 18, np.float32)
        rr.barrier(name="start")
        threading.Timer(args.delay, die).start()
        while True:
            rr.allreduce_(buf, op=rr.Average, name="victim-watch")
    elif args.scenario == "idle":
        time.sleep(args.delay)
        die()
    elif args.scenario == "leave":
        time.sleep(args.delay)
        size = rr.size()
        event("killing", how="shutdown")
        rr.shutdown()
        linger(args, size)  # alive, until the survivors have noticed
    elif args.scenario == "raise":
        time.sleep(args.delay)
        event("killing", how="exception")
        raise RuntimeError("injected failure on the victim rank")


def mismatch(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    sizes = [int(s) for s in args.sizes.split(",")]
    try:
        rr.allreduce(np.zeros(sizes[r % len(sizes)], np.float32), op=rr.Sum, name="mm")
        event("no-error")
    except rr.RingReduceError as err:
        error_event("raised", err)
    got = rr.allreduce(np.full(5, r + 1.0, np.float32), op=rr.Sum, name="after-mismatch")
    want = n * (n + 1) / 2
    assert (got == want).all(), f"allreduce after the mismatch gave {got}, want {want}"
    big = rr.allreduce(np.ones(300000, np.float32), op=rr.Sum)
    assert (big == n).all(), "large allreduce after the mismatch is wrong"
    event("recovered")


def join() -> None:
    try:
        rr.init()
        rr.barrier()
        event("joined")
    except rr.RingReduceError as err:
        error_event("raised", err)


def main(args: argparse.Namespace) -> None:
    watch_job()
    if args.scenario == "join":
        return join()
    rr.init()
    rank = rr.rank()
    set_rank(rank)
    event("ready")
    if args.scenario == "mismatch":
        mismatch(args)
    elif rank == args.victim:
        victim(args)
    else:
        survive(args)
    say(f"OK rank {rank}")


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True,
                   choices=[*KILLS, "leave", "raise", "mismatch", "join"])
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--delay", type=float, default=0.5, help="seconds before the victim acts")
    p.add_argument("--sync-dir", default=".")
    p.add_argument("--linger", type=float, default=8.0)
    p.add_argument("--sizes", default="10,11")
    p.add_argument("--mb", type=int, default=64, help="allreduce size in 'during'")
    p.add_argument("--once", action="store_true", help="survivors make a single call")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse()
    # "raise" is about the ordinary exit path of an exception: no os._exit there.
    run(lambda: main(ARGS), hard_exit=ARGS.scenario != "raise")
