"""init()/shutdown() life cycle of the module-level API.

    python lifecycle_worker.py --uninitialized-only   # no init at all
    python lifecycle_worker.py                        # init twice, shutdown, init again

Checks that every call before init() (and after shutdown()) raises
NotInitializedError, that a second init() is a no-op, and that init() after
shutdown() joins a working job again. Logs ``OK rank <r>``.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

import numpy as np
from workerlib import run, say, set_rank, watch_job

import ringreduce as rr

CALLS: dict[str, Callable[[], Any]] = {
    "allreduce": lambda: rr.allreduce(np.ones(2, np.float32)),
    "allreduce_": lambda: rr.allreduce_(np.ones(2, np.float32)),
    "allgather": lambda: rr.allgather(np.ones(2)),
    "broadcast": lambda: rr.broadcast(np.ones(2), 0),
    "reducescatter": lambda: rr.reducescatter(np.ones(2)),
    "alltoall": lambda: rr.alltoall(np.ones(2)),
    "barrier": rr.barrier,
    "broadcast_object": lambda: rr.broadcast_object(1),
    "allgather_object": lambda: rr.allgather_object(1),
    "rank": rr.rank,
    "size": rr.size,
    "local_rank": rr.local_rank,
    "cross_size": rr.cross_size,
}


def expect_not_initialized(when: str) -> None:
    assert not rr.is_initialized(), f"is_initialized() is true {when}"
    for label, call in CALLS.items():
        try:
            call()
        except rr.NotInitializedError as err:
            assert "init()" in str(err), f"{label} {when}: unhelpful message {err}"
        else:
            raise AssertionError(f"{label} {when} did not raise NotInitializedError")


def check_sum(rank: int, size: int, base: float) -> None:
    got = rr.allreduce(np.full(5, base + rank, np.float64), op=rr.Sum)
    want = size * base + size * (size - 1) / 2
    assert (got == want).all(), f"rank {rank}: allreduce gave {got}, want {want}"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--uninitialized-only", action="store_true")
    args = p.parse_args(argv)
    expect_not_initialized("before init()")
    if args.uninitialized_only:
        say("OK rank 0")
        return
    watch_job()
    rr.init()
    rank, size = rr.rank(), rr.size()
    set_rank(rank)
    comm = rr._Process.comm
    rr.init()
    assert rr._Process.comm is comm, "a second init() replaced the communicator"
    assert (rr.rank(), rr.size()) == (rank, size)
    check_sum(rank, size, 1.0)

    rr.shutdown()
    expect_not_initialized("after shutdown()")
    rr.shutdown()  # harmless when not initialized

    rr.init()  # a new job: new secret, new links, new shared memory
    assert (rr.rank(), rr.size()) == (rank, size), "rank/size changed after re-init"
    check_sum(rank, size, 10.0)
    big = rr.allreduce(np.ones(1 << 20, np.float32), op=rr.Sum, name="big-after-reinit")
    assert (big == size).all(), "large allreduce after re-init is wrong"
    rr.barrier()
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
