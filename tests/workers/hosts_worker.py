"""Ranks for tests/test_hosts.py (ranks in network namespaces); ``hosts_worker.py MODE``.

basic    layout and transports (``layout``), collectives with known results, then
         a call refused on one rank only: rank 1 broadcasts with an invalid root
         (named) and allreduces with an invalid op (unnamed), catching the errors;
         the others make the valid calls and must raise at once naming rank 1
         (``refused`` events); a later unnamed allreduce must still line up.
loop     1 MiB allreduces every 10 ms; ``looping`` after the first ones, then
         ``raised`` (class, message, time) at the first error. With ``--stop V``
         rank V SIGSTOPs itself after ``looping``; every other rank, once it
         raised, SIGKILLs it (so the job ends).
job V    Sum-allreduce V (this job's value) 60 times, 25 ms apart; ``result`` or ``raised``;
         ``--after F`` waits for file F before init, ``--hold F`` creates F after the
         allreduces and stays in the job 3 s more.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import numpy as np
from workerlib import error_event, event, run, say, watch_job


def basic(rr) -> None:
    r, n = rr.rank(), rr.size()
    event("layout", local=[rr.local_rank(), rr.local_size()],
          cross=[rr.cross_rank(), rr.cross_size()],
          transports={p: rr._comm().transport_to(p) for p in range(n) if p != r})
    total = rr.allreduce(np.array([r + 1.0]), op=rr.Sum, name="small")[0]
    assert total == n * (n + 1) / 2, total
    big = rr.allreduce(np.full(1 << 20, float(r), np.float32), op=rr.Sum, name="big")
    assert np.all(big == sum(range(n))), big[:4]
    gathered = rr.allgather(np.full((r + 1, 2), r, np.int32), name="gather")
    assert gathered.shape == (n * (n + 1) // 2, 2)
    root = rr.broadcast(np.array([r * 10]), root_rank=n - 1, name="bcast")
    assert root[0] == (n - 1) * 10
    start = time.monotonic()
    for name, call, bad in (
            ("named", lambda: rr.broadcast(np.ones(3), root_rank=0, name="refused"),
             lambda: rr.broadcast(np.ones(3), root_rank=n + 1, name="refused")),
            ("unnamed", lambda: rr.allreduce(np.ones(3)),
             lambda: rr.allreduce(np.ones(3), op=99))):
        try:
            (bad if r == 1 else call)()
            event("refused", case=name, ok=True)
        except rr.RingReduceError as err:
            event("refused", case=name, cls=type(err).__name__, msg=str(err),
                  after_s=time.monotonic() - start)
    after = rr.allreduce(np.array([1.0]), op=rr.Sum)[0]  # unnamed: names still in step
    assert after == n, after
    say(f"OK rank {r}")


def loop(rr, stop: int) -> None:
    x = np.ones(1 << 18, np.float32)  # 1 MiB
    for _ in range(5):
        rr.allreduce_(x, op=rr.Sum, name="grad")
    event("looping", pid=os.getpid())
    if rr.rank() == stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.time()
    try:
        while time.time() - start < 120:
            x[:] = 1
            rr.allreduce_(x, op=rr.Sum, name="grad")
            time.sleep(0.01)
        event("no-error")
    except rr.RingReduceError as err:
        error_event("raised", err)
    if stop >= 0 and rr.rank() != stop:
        # Once every other rank raised (its death must not be what they report)
        survivors = [q for q in range(rr.size()) if q != stop]
        deadline = time.time() + 20
        while time.time() < deadline and not all(events(q, "raised") for q in survivors):
            time.sleep(0.05)
        try:
            os.kill(events(stop, "looping")[0]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass  # another rank was first


def events(rank: int, ev: str) -> list:
    with open(os.path.join(os.environ["RR_TEST_LOG_DIR"], f"rank{rank}.log")) as f:
        lines = [json.loads(line) for line in f.read().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("ev") == ev]


def job(rr, value: float, hold: str) -> None:
    try:
        for _ in range(60):  # ~1.5 s: two jobs started at once overlap
            total = rr.allreduce(np.array([value]), op=rr.Sum, name="v")[0]
            time.sleep(0.025)
        event("result", total=float(total), size=rr.size())
    except rr.RingReduceError as err:
        error_event("raised", err)
    if hold:
        open(hold, "w").close()
        time.sleep(3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["basic", "loop", "job"])
    p.add_argument("--stop", type=int, default=-1)
    p.add_argument("--value", type=float, default=1.0)
    p.add_argument("--after", default="")
    p.add_argument("--hold", default="")
    args = p.parse_args()
    deadline = time.time() + 30
    while args.after and not os.path.exists(args.after) and time.time() < deadline:
        time.sleep(0.05)
    watch_job()
    import ringreduce as rr

    try:
        rr.init()
    except rr.RingReduceError as err:
        error_event("init-raised", err)
        return
    threading.current_thread().name = f"rank{rr.rank()}"
    if args.mode == "basic":
        basic(rr)
    elif args.mode == "loop":
        loop(rr, args.stop)
    else:
        job(rr, args.value, args.hold)
    rr.shutdown()


if __name__ == "__main__":
    run(main)
