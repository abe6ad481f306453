"""Fault injection: one rank (the victim) fails at a chosen point, the others report.

    python fault_worker.py --scenario SCENARIO [--victim V] [--sync-dir D]

Scenarios for the victim:

* ``during``: SIGKILL itself from a thread while a ``--mb`` (64) MB allreduce
  is running (``--elements``: that many float32, a loop of small blocking calls
  whose rounds the callers drive, coordination/engine_drive.cc; the survivors
  loop on it, or make one call with ``--once``); with
  ``--shared`` the buffer is a shared one, so the allreduce reads the victim's
  memory directly;
* ``idle``: sleep, then SIGKILL itself while the others wait in an allreduce;
* ``init``: SIGKILL itself right after every rank's init() has returned, before
  any collective (the survivors make their first call ``--delay`` s later, when it
  is surely dead; a rank still inside init() would see a death during init, which
  is not this scenario);
* ``leave``: call rr.shutdown() while the others wait, then stay alive a while;
* ``negotiation``: every rank submits named async allreduces of ``--tensors``
  gradients, each rank in its own order (as a backward pass would); the victim
  submits only the first ``--submit`` of them (``--gap`` s apart) and SIGKILLs
  itself ``--delay`` s after the start, so the survivors are left with tensors
  that can only run once the victim submits them too. The survivors
  synchronize every handle and log the outcome of each (``handles``);
* ``engine-idle``: all ranks make a few successful collectives, then nobody
  calls anything: the victim SIGKILLs itself after ``--delay`` s, the
  survivors sleep ``--idle`` s (their engines must notice by themselves) and
  then call an allreduce (``calling``, then ``raised``);
* ``held``: after a warm-up the victim SIGKILLs itself after ``--delay`` s while
  each survivor has one async allreduce submitted and only polls it, under a
  batching window (``RINGREDUCE_BATCH_US``, set by the test) far longer than
  the test: the engines hold that work back and must still notice the death
  (``polling``, then ``raised``);
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
* ``join``: init() and a barrier; logs ``joined`` or ``raised``;
* ``frozen-leave``: the victim stops itself (SIGSTOP); each survivor's thread waits
  in an allreduce that needs it while its main thread calls rr.shutdown() 1 s later
  (``left``: how long that took, and the waiting call's error); once all have left
  (files in ``--sync-dir``) they SIGKILL the victim so that the job ends.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
from workerlib import error_event, event, run, say, set_rank, watch_job

import ringreduce as rr

KILLS = ("during", "idle", "init", "negotiation", "engine-idle", "held")


def die(**fields: object) -> None:
    event("killing", pid=os.getpid(), **fields)
    os.kill(os.getpid(), signal.SIGKILL)


def error_fields(err: BaseException) -> dict:
    """What ``error_event`` logs about an exception, as a dict."""
    return {"cls": type(err).__name__, "rr": isinstance(err, rr.RingReduceError),
            "msg": str(err)}


# ---------------------------------------------------------- negotiation
def grad_size(i: int) -> int:
    """Mixed sizes, like a gradient list: every 5th is 1 MB, the rest a few KB."""
    return 1 << 18 if i % 5 == 0 else 1000 + 700 * i


def backward_order(rank: int, count: int) -> list[str]:
    """The gradient names in the order this rank submits them (its own on every rank)."""
    order = list(range(count))
    random.Random(rank).shuffle(order)
    return [f"grad.{i}" for i in order]


def submit_grads(names: list[str]) -> dict:
    """Start a Sum allreduce of rank + 1 for every name; handles by name."""
    value = rr.rank() + 1.0
    return {name: rr.allreduce_async(np.full(grad_size(int(name[5:])), value, np.float32),
                                     op=rr.Sum, name=name)
            for name in names}


def negotiation_survivor(args: argparse.Namespace) -> None:
    """Synchronize every handle; those the victim never submitted must raise."""
    n = rr.size()
    rr.barrier(name="start")
    handles = submit_grads(backward_order(rr.rank(), args.tensors))
    event("submitted", names=list(handles))
    want = n * (n + 1) / 2
    ok, failed = [], {}
    for name, h in handles.items():
        try:
            out = rr.synchronize(h)
        except Exception as err:
            if not failed:
                event("raised", tensor=name, **error_fields(err))
            failed[name] = error_fields(err)
            continue
        assert (out == want).all(), f"'{name}' gave {out[:4]}..., want {want}"
        ok.append(name)
    event("handles", ok=ok, failed=failed)
    after_failure(args)


def negotiation_victim(args: argparse.Namespace) -> None:
    """Submit ``--submit`` gradients, ``--gap`` s apart; die ``--delay`` s after the start.

    With a gap the kill may come while it is still submitting, with rounds
    in progress; each submission is logged (``submit``) just before it is made.
    """
    rr.barrier(name="start")
    handles: dict = {}

    def kill() -> None:  # log how far it got
        die(delay=args.delay, submitted=len(handles),
            completed=sum(rr.poll(h) for h in list(handles.values())))

    threading.Timer(args.delay, kill).start()
    for name in backward_order(rr.rank(), args.tensors)[:args.submit]:
        event("submit", name=name)
        handles.update(submit_grads([name]))
        time.sleep(args.gap)
    for h in handles.values():
        rr.synchronize(h)
    event("victim-synchronized")
    time.sleep(60)


# ---------------------------------------------------------- engine idle
def engine_idle(args: argparse.Namespace) -> None:
    """A few good collectives, then silence; the victim dies during it."""
    r, n = rr.rank(), rr.size()
    rr.barrier(name="start")
    for _ in range(3):  # the same name again: the response cache's path too
        out = rr.allreduce(np.full(1000, r + 1.0, np.float32), op=rr.Sum, name="warm")
        assert (out == n * (n + 1) / 2).all(), f"warm-up allreduce gave {out[:4]}"
    assert rr.allgather(np.array([r])).tolist() == list(range(n))
    assert (rr.broadcast(np.full(3, r, np.int32), root_rank=0, name="warm-bcast") == 0).all()
    event("idle")
    if r == args.victim:
        time.sleep(args.delay)
        die(delay=args.delay)
    time.sleep(args.idle)  # no calls at all: only the engine can notice
    event("calling")
    try:
        rr.allreduce(np.ones(4, np.float32), name="after-idle")
        event("no-error")
    except Exception as err:
        error_event("raised", err)
    after_failure(args)


def big_buffer(args: argparse.Namespace) -> np.ndarray:
    """The ``during`` scenario's buffer: ones, in a shared buffer with ``--shared``."""
    count = args.elements or args.mb << 18
    if not args.shared:
        return np.ones(count, np.float32)
    buf = rr.shared_zeros(count, np.float32)
    buf[:] = 1
    return buf


def held(args: argparse.Namespace) -> None:
    """One async allreduce that the engine holds back; the caller polls, never waits."""
    r, n = rr.rank(), rr.size()
    rr.barrier(name="start")
    out = rr.allreduce(np.full(4, r + 1.0, np.float32), op=rr.Sum, name="warm")
    assert (out == n * (n + 1) / 2).all(), f"warm-up allreduce gave {out}"
    if r == args.victim:
        time.sleep(args.delay)
        die(delay=args.delay)
    h = rr.allreduce_async(np.ones(4, np.float32), name="held")
    event("polling")
    deadline = time.monotonic() + args.idle
    while not rr.poll(h) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        rr.synchronize(h)  # done by now unless the engine never noticed
        event("no-error")
    except Exception as err:
        error_event("raised", err)
    after_failure(args)


def survive(args: argparse.Namespace) -> None:
    """Loop on allreduces until one fails; log it and what the next collective does."""
    buf = big_buffer(args) if args.scenario == "during" else np.ones(1000, np.float32)
    if args.scenario == "during":
        rr.barrier(name="start")  # the victim's clock starts here too
    if args.scenario == "init":  # the victim dies once every rank's init() returned
        if not wait_for_files(args, "ready-*", rr.size(), timeout=20.0):
            event("ready-timeout")
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
    stats = rr._comm()._engine.stats()
    event("completed", allreduces=done, caller_rounds=stats["caller_rounds"],
          paired=stats["paired"])
    after_failure(args)


def after_failure(args: argparse.Namespace) -> None:
    """Log what the next collective does, then wait for the other survivors."""
    try:
        rr.allreduce(np.ones(4, np.float32), name="after-failure")
        event("next-ok")
    except Exception as err:
        error_event("next-raised", err)
    (Path(args.sync_dir) / f"survivor-{rr.rank()}").touch()
    linger(args, rr.size())


def wait_for_files(args: argparse.Namespace, pattern: str, count: int, timeout: float) -> bool:
    """Wait until ``count`` files match ``pattern`` in the sync dir (False: timed out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(Path(args.sync_dir).glob(pattern))) >= count:
            return True
        time.sleep(0.02)
    return False


def linger(args: argparse.Namespace, size: int) -> None:
    """Stay alive until every survivor has reported (or ``--linger`` s passed)."""
    if not wait_for_files(args, "survivor-*", size - 1, args.linger):
        event("linger-timeout")


def victim(args: argparse.Namespace) -> None:
    if args.scenario == "init":
        if not wait_for_files(args, "ready-*", rr.size(), timeout=20.0):
            event("ready-timeout")
        die()
    elif args.scenario == "during":
        buf = big_buffer(args)
        rr.barrier(name="start")
        threading.Timer(args.delay, lambda: die(delay=args.delay)).start()
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


def frozen_leave(args: argparse.Namespace) -> None:
    pids = rr.allgather_object(os.getpid())
    if rr.rank() == args.victim:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    errors: list = []

    def call() -> None:
        try:
            rr.allreduce(np.ones(1 << 16, np.float32), name="frozen")
        except rr.RingReduceError as err:
            errors.append(str(err))

    waiting = threading.Thread(target=call)
    waiting.start()
    time.sleep(1.0)
    began = time.monotonic()
    rr.shutdown()
    took = time.monotonic() - began
    waiting.join(10)
    event("left", seconds=took, errors=errors)
    (Path(args.sync_dir) / f"left-{len(pids)}-{pids.index(os.getpid())}").touch()
    # the victim dies only once every survivor has left: its death is no one's reason
    if wait_for_files(args, f"left-{len(pids)}-*", len(pids) - 1, 20):
        os.kill(pids[args.victim], signal.SIGKILL)


def main(args: argparse.Namespace) -> None:
    watch_job()
    if args.scenario == "join":
        return join()
    rr.init()
    rank = rr.rank()
    set_rank(rank)
    event("ready")
    if args.scenario == "init":  # the victim waits for every rank's file
        (Path(args.sync_dir) / f"ready-{rank}").touch()
    if args.scenario == "mismatch":
        mismatch(args)
    elif args.scenario == "frozen-leave":
        frozen_leave(args)
    elif args.scenario == "engine-idle":
        engine_idle(args)
    elif args.scenario == "held":
        held(args)
    elif args.scenario == "negotiation":
        (negotiation_victim if rank == args.victim else negotiation_survivor)(args)
    elif rank == args.victim:
        victim(args)
    else:
        survive(args)
    say(f"OK rank {rank}")


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True,
                   choices=[*KILLS, "leave", "raise", "mismatch", "join", "frozen-leave"])
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--delay", type=float, default=0.5, help="seconds before the victim acts")
    p.add_argument("--sync-dir", default=".")
    p.add_argument("--linger", type=float, default=8.0)
    p.add_argument("--sizes", default="10,11")
    p.add_argument("--mb", type=int, default=64, help="allreduce size in 'during'")
    p.add_argument("--elements", type=int, default=0,
                   help="allreduce size in 'during' in float32 elements (instead of --mb)")
    p.add_argument("--once", action="store_true", help="survivors make a single call")
    p.add_argument("--shared", action="store_true",
                   help="'during': the buffer is a shared one (rr.shared_zeros)")
    p.add_argument("--tensors", type=int, default=20, help="gradients in 'negotiation'")
    p.add_argument("--submit", type=int, default=10,
                   help="how many of them the victim submits in 'negotiation'")
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds between the victim's submissions in 'negotiation'")
    p.add_argument("--idle", type=float, default=2.0,
                   help="seconds the survivors sleep in 'engine-idle' (poll in 'held')")
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse()
    # "raise" is about the ordinary exit path of an exception: no os._exit there.
    run(lambda: main(ARGS), hard_exit=ARGS.scenario != "raise")
