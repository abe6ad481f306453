"""The background engine across real processes: one scenario per launch.

    python engine_worker.py --scenario SCENARIO [--seed S] [--late S]

Scenarios (every rank checks its own results and logs ``OK rank <r>`` at the end):

* ``orders``: two steps of ~30 named float32 allreduces (1 element to 1M,
  integer-valued, so every sum is exact in any order), submitted async by each
  rank in its own random order (``--seed``), some in place, synchronized in
  yet another order. Every result is checked against the exact sum (or max);
  the digest of all results is logged (``results``) and compared between
  ranks. The test runs it with and without fusion and compares the digests.
* ``join``: uneven data. Rank r runs r + 2 steps of an Average allreduce
  named ``grad`` (of r + 1) and an allgather (of r + 1 rows), then
  ``rr.join()``; Average must divide by the contributing ranks only, the
  allgather hold only their rows, and join return the last rank everywhere
  (``joined``). Then a second round the other way round (rank 0 has the
  most steps), and plain collectives afterwards.
* ``mismatch``: ``mm`` submitted as float32[4,5] on every rank but rank 1,
  which sends float32[5,4], between two good async allreduces; the
  MismatchError is logged (``raised``); the good ones, ``mm`` with agreeing
  shapes and other collectives must work afterwards (``recovered``).
* ``stall``: after a barrier rank 1 waits ``--late`` s before submitting
  ``slowpoke``, which must then complete (``completed``). The process's
  stderr (where the C++ core logs the stall warnings) goes to
  ``$RR_TEST_LOG_DIR/rank<r>.stderr`` for the test to read.
* ``stall-shutdown``: rank r allreduces ``grad<r>``: nothing ever becomes
  ready; every rank must raise (``raised``, with ``took`` seconds) once
  RINGREDUCE_STALL_SHUTDOWN_SECONDS has passed, then its next call too
  (``next-raised``).
* ``timeline``: async allreduces large (ring) and small, an allgather and a
  broadcast, then shutdown; the test reads RINGREDUCE_TIMELINE.
* ``small-calls``: 300 blocking small allreduces (named and unnamed, Sum and
  Max, float32 and int64), barriers, broadcasts, ragged allgathers and object
  calls, a random rank late now and then (a few
  beyond the hold of paired rounds), each result checked; the engine's counts
  are logged (``small``: ``folded``, ``paired``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
from typing import Any, Optional

import numpy as np
from workerlib import error_event, event, launch_rank, run, say, set_rank, watch_job

import ringreduce as rr

# ~30 gradients from 1 element to 1M floats (~10 MB in all): around the small-message
# size (64 KiB = 16384 floats), odd counts, pipeline-chunk multiples.
SIZES = [1, 2, 3, 5, 7, 16, 31, 64, 100, 255, 256, 1000, 1023, 4096, 9999, 16384, 16385,
         20000, 32768, 50001, 65536, 100003, 131072, 200000, 262145, 300000, 500000, 1 << 20,
         3, 1]


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {rr.rank()}: {what}")


def check_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    check(got.dtype == want.dtype and got.shape == want.shape,
          f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size:
        i = bad[0]
        check(False, f"{what}: {bad.size} elements differ, first at {i}: got "
                     f"{got.reshape(-1)[i]!r}, want {want.reshape(-1)[i]!r}")


def stderr_to_file() -> None:
    """Send fd 2 (the C++ core logs there) to ``$RR_TEST_LOG_DIR/rank<r>.stderr``.

    Under mpirun Hydra merges the ranks' stderr; a file per rank says which
    rank printed what. A traceback of a failing worker lands there too.
    """
    log_dir = os.environ.get("RR_TEST_LOG_DIR")
    if not log_dir:
        return
    fd = os.open(os.path.join(log_dir, f"rank{launch_rank()}.stderr"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)


# ------------------------------------------------------------------ orders
def grad(rank: int, seed: int, step: int, i: int) -> np.ndarray:
    """Rank ``rank``'s i-th gradient: integers in [-1000, 1000) as float32."""
    rng = np.random.default_rng([seed, step, i, rank])
    return rng.integers(-1000, 1000, SIZES[i]).astype(np.float32)


def grad_op(i: int) -> int:
    return rr.Max if i % 5 == 3 else rr.Sum  # two fusion groups


def orders(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    digest = hashlib.sha256()
    for step in range(2):  # the second step goes through the response cache
        rng = random.Random(f"{args.seed}-{step}-{r}")
        submit = list(range(len(SIZES)))
        rng.shuffle(submit)
        wait = list(range(len(SIZES)))
        rng.shuffle(wait)
        mine = [grad(r, args.seed, step, i) for i in range(len(SIZES))]
        inputs = [x.copy() for x in mine]
        rr.barrier(name=f"step{step}")
        handles = {}
        for i in submit:
            if i % 3 == 0:  # in place
                handles[i] = rr.allreduce_async_(mine[i], op=grad_op(i), name=f"grad.{i}")
            else:
                handles[i] = rr.allreduce_async(mine[i], op=grad_op(i), name=f"grad.{i}")
            if rng.random() < 0.1:
                time.sleep(0.002)  # spread the submissions over several rounds
        event("submitted", step=step, order=submit)
        results = {}
        for i in wait:
            out = rr.synchronize(handles[i])
            if i % 3 == 0:
                check(out is mine[i], f"grad.{i}: allreduce_async_ did not return its buffer")
            else:
                check_equal(mine[i], inputs[i], f"grad.{i}: input modified")
            results[i] = out
        for i in range(len(SIZES)):
            every = np.stack([grad(p, args.seed, step, i) for p in range(n)])
            want = every.max(0) if grad_op(i) == rr.Max else every.sum(0)
            check_equal(results[i], want, f"step {step} grad.{i} ({SIZES[i]} floats)")
            digest.update(results[i].tobytes())
    mine_hex = digest.hexdigest()
    event("results", digest=mine_hex, tensors=len(SIZES))
    everyone = rr.allgather_object(mine_hex, name="digests")
    check(everyone == [mine_hex] * n, f"results differ between ranks: {everyone}")


# -------------------------------------------------------------------- join
def join_round(label: str, steps: list[int]) -> None:
    """Rank p runs ``steps[p]`` steps, then joins; checks every result."""
    r, n = rr.rank(), rr.size()
    for step in range(steps[r]):
        contributors = [p for p in range(n) if steps[p] > step]
        avg = rr.allreduce(np.full(4, r + 1.0, np.float32), op=rr.Average, name="grad")
        want = sum(p + 1.0 for p in contributors) / len(contributors)
        check_equal(avg, np.full(4, want, np.float32),
                    f"{label} step {step}: Average over ranks {contributors}")
        rows = rr.allgather(np.full((r + 1, 2), 100 * r + step, np.int32), name="ag")
        want_rows = np.concatenate([np.full((p + 1, 2), 100 * p + step, np.int32)
                                    for p in contributors])
        check_equal(rows, want_rows, f"{label} step {step}: allgather of ranks {contributors}")
    t0 = time.monotonic()
    last = rr.join()
    event("joined", round=label, last=last, steps=steps[r], waited=time.monotonic() - t0)
    want_last = max(range(n), key=lambda p: steps[p])
    check(last == want_last, f"{label}: join() returned {last}, want {want_last}")


def join(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    join_round("first", [p + 2 for p in range(n)])  # the last rank joins last
    join_round("second", [n + 1 - p for p in range(n)])  # rank 0 joins last
    out = rr.allreduce(np.full(5, r + 1.0, np.float32), op=rr.Average, name="grad")
    check_equal(out, np.full(5, (n + 1) / 2, np.float32), "Average after join")
    rows = rr.allgather(np.array([r], np.int64), name="ag")
    check_equal(rows, np.arange(n, dtype=np.int64), "allgather after join")
    b = rr.broadcast(np.full(3, r, np.int32), root_rank=n - 1, name="after-join")
    check_equal(b, np.full(3, n - 1, np.int32), "broadcast after join")
    event("after-join")


# ---------------------------------------------------------------- mismatch
MISMATCH_SHAPES = {"odd": (5, 4), "others": (4, 5)}  # rank 1 sends the odd one


def mismatch(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    total = n * (n + 1) / 2
    shape = MISMATCH_SHAPES["odd" if r == 1 else "others"]
    before = rr.allreduce_async(np.full(300000, r + 1.0, np.float32), op=rr.Sum, name="before")
    bad = rr.allreduce_async(np.zeros(shape, np.float32), op=rr.Sum, name="mm")
    after = rr.allreduce_async(np.full(1000, r + 1.0, np.float32), op=rr.Sum, name="after")
    try:
        rr.synchronize(bad)
        event("no-error")
    except rr.RingReduceError as err:
        error_event("raised", err)
    check_equal(rr.synchronize(before), np.full(300000, total, np.float32), "'before'")
    check_equal(rr.synchronize(after), np.full(1000, total, np.float32), "'after'")
    # The name is free again, and everything still works.
    good = rr.allreduce(np.full((4, 5), r + 1.0, np.float32), op=rr.Sum, name="mm")
    check_equal(good, np.full((4, 5), total, np.float32), "'mm' with agreeing shapes")
    big = rr.allreduce(np.ones(1 << 18, np.float32), op=rr.Sum, name="big")
    check_equal(big, np.full(1 << 18, n, np.float32), "large allreduce after the mismatch")
    rows = rr.allgather(np.full((r + 1, 3), r, np.int32))
    check_equal(rows, np.concatenate([np.full((p + 1, 3), p, np.int32) for p in range(n)]),
                "allgather after the mismatch")
    rr.barrier()
    event("recovered")


# ------------------------------------------------------------------- stall
def stall(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    rr.barrier(name="start")
    if r == 1:
        time.sleep(args.late)
    t0 = time.monotonic()
    out = rr.allreduce(np.full(3, r + 1.0, np.float32), op=rr.Sum, name="slowpoke")
    check_equal(out, np.full(3, n * (n + 1) / 2, np.float32), "'slowpoke'")
    event("completed", waited=time.monotonic() - t0)
    again = rr.allreduce(np.ones(1000, np.float32), op=rr.Sum, name="after-stall")
    check_equal(again, np.full(1000, n, np.float32), "allreduce after the stall")


def stall_shutdown(args: argparse.Namespace) -> None:
    r = rr.rank()
    rr.barrier(name="start")
    t0 = time.monotonic()
    try:
        rr.allreduce(np.ones(3, np.float32), op=rr.Sum, name=f"grad{r}")  # never ready
        event("no-error")
    except rr.RingReduceError as err:
        event("raised", cls=type(err).__name__, msg=str(err), took=time.monotonic() - t0)
    try:
        rr.allreduce(np.ones(3, np.float32), op=rr.Sum, name="after")
        event("next-ok")
    except rr.RingReduceError as err:
        error_event("next-raised", err)


# ---------------------------------------------------------------- timeline
def timeline(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    sizes = [200000, 3, 70000, 1000, 300000, 17]  # > 64 KiB: ring; the rest: direct
    order = list(range(len(sizes)))
    random.Random(f"{args.seed}-{r}").shuffle(order)
    handles = {i: rr.allreduce_async(np.full(sizes[i], r + 1.0, np.float32), op=rr.Sum,
                                     name=f"t{i}") for i in order}
    for i, h in handles.items():
        check_equal(rr.synchronize(h), np.full(sizes[i], n * (n + 1) / 2, np.float32), f"t{i}")
    rows = rr.allgather(np.full((2, 2), r, np.int32), name="ag")
    check(rows.shape == (2 * n, 2), f"allgather gave {rows.shape}")
    b = rr.broadcast(np.full(100000, r, np.float32), root_rank=0, name="bc")
    check((b == 0).all(), "broadcast")


# ------------------------------------------------------------- small calls
def small_movement(i: int, kind: int, r: int, n: int) -> None:
    """One small broadcast (root turning), ragged allgather or object call, checked."""
    if kind == 4:
        root = i % n
        out = rr.broadcast_(np.full(5, r * 10 + i, np.int64), root, name="cfg")
        check_equal(out, np.full(5, root * 10 + i, np.int64), f"call {i}: 'cfg'")
    elif kind == 5:
        out = rr.allgather(np.full((r + 1, 2), r, np.float32))  # unnamed, ragged
        want = np.concatenate([np.full((q + 1, 2), q, np.float32) for q in range(n)])
        check_equal(out, want, f"call {i}: allgather")
    else:
        got = (rr.broadcast_object({"step": i, "from": r}, i % n, name="obj"),
               rr.allgather_object((r, i)))
        check(got == ({"step": i, "from": i % n}, [(q, i) for q in range(n)]),
              f"call {i}: objects {got}")


def small_calls(args: argparse.Namespace) -> None:
    r, n = rr.rank(), rr.size()
    rng = random.Random(args.seed)  # the same draws on every rank
    for i in range(300):
        late, pause = rng.randrange(n), rng.choice([0, 0, 0, 0, 1e-4, 3e-3])
        if late == r and pause:
            time.sleep(pause)
        kind = i % 7
        if kind == 0:
            out = rr.allreduce(np.full(1, r + 1.0, np.float32), op=rr.Sum, name="loss")
            check_equal(out, np.full(1, n * (n + 1) / 2, np.float32), f"call {i}: 'loss'")
        elif kind == 1:
            out = rr.allreduce(np.arange(8, dtype=np.int64) * (r + 1), op=rr.Max, name="acc")
            check_equal(out, np.arange(8, dtype=np.int64) * n, f"call {i}: 'acc'")
        elif kind == 2:
            out = rr.allreduce(np.full(3, float(r)), op=rr.Sum)  # unnamed: never cached
            check_equal(out, np.full(3, n * (n - 1) / 2), f"call {i}: unnamed")
        elif kind == 3:
            rr.barrier()
        else:
            small_movement(i, kind, r, n)
    stats = rr._comm()._engine.stats()
    event("small", folded=stats["folded"], paired=stats["paired"])


SCENARIOS: dict[str, Any] = {
    "orders": orders, "join": join, "mismatch": mismatch, "stall": stall,
    "stall-shutdown": stall_shutdown, "timeline": timeline, "small-calls": small_calls,
}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--late", type=float, default=1.5, help="rank 1's delay in 'stall'")
    args = p.parse_args(argv)
    if args.scenario == "stall":
        stderr_to_file()
    watch_job()
    rr.init()
    rank = rr.rank()
    set_rank(rank)
    event("ready", size=rr.size())
    t0 = time.monotonic()
    SCENARIOS[args.scenario](args)
    event("done", seconds=time.monotonic() - t0)
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
