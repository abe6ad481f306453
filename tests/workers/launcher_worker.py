"""Ranks for tests/test_launcher.py; ``launcher_worker.py MODE [ARGS]``.

allreduce        init, Sum-allreduce rank+1, print the layout and the result
fail R C         print pids; rank R exits with code C after 0.3 s, the others sleep
sleep            print pids (and of a child ``sleep``), then sleep
ignore-term      like sleep, but SIGTERM is ignored (only SIGKILL ends it)
env              print the launch variables
settings         init, print the RINGREDUCE_* settings as JSON and the Sum of rank+1
stall            init; rank 0 allreduces, rank 1 never does (sleeps): rank 0 prints the error
"""

import json
import os
import signal
import subprocess
import sys
import time


def pids() -> None:
    child = subprocess.Popen(["sleep", "120"])
    print(f"pid {os.getpid()} child {child.pid}", flush=True)


def autotune() -> None:
    """Steps of three named allreduces until the autotuner is done; its settings, per rank."""
    import numpy as np

    import ringreduce as rr

    rr.init()
    xs = [np.full(k, rr.rank() + 1.0) for k in (5, 3000, 70000)]
    stats = rr._comm()._engine.stats
    for _ in range(2000):
        try:
            hs = [rr.allreduce_async(x, op=rr.Sum, name=f"g{i}") for i, x in enumerate(xs)]
            for h in hs:
                assert (rr.synchronize(h) == 3.0).all()
        except rr.RingReduceError as e:  # one write: the ranks' tracebacks would interleave
            sys.stdout.write(f"error {rr.rank()} {type(e).__name__}: {e}\n")
            sys.stdout.flush()
            sys.exit(1)
        if not stats()["autotuning"]:
            break
    keys = ("autotuning", "autotune_trials", "fusion_threshold", "cycle_time_ms", "batch_us")
    print(f"autotune {rr.rank()} {({k: stats()[k] for k in keys})}", flush=True)
    rr.shutdown()


def settings_or_stall(mode: str) -> None:
    import numpy as np

    import ringreduce as rr

    rr.init()
    if mode == "settings":
        ours = {
            k: v
            for k, v in os.environ.items()
            if k.startswith("RINGREDUCE_") and k not in ("RINGREDUCE_SECRET", "RINGREDUCE_HOST_ID")
        }
        total = rr.allreduce(np.array([rr.rank() + 1.0]), op=rr.Sum, name="x")[0]
        print(f"settings {json.dumps(ours, sort_keys=True)} sum {total:g}", flush=True)
    elif rr.rank() == 0:
        start = time.monotonic()
        try:
            rr.allreduce(np.ones(2), name="lonely")
        except rr.RingReduceError as e:
            print(f"after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
    else:
        time.sleep(5)
    rr.shutdown()


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    if mode == "allreduce":
        import numpy as np

        import ringreduce as rr

        rr.init()
        total = rr.allreduce(np.array([rr.rank() + 1.0]), op=rr.Sum, name="x")[0]
        sys.stdout.write(f"rank {rr.rank()} size {rr.size()} local {rr.local_rank()}/"
                         f"{rr.local_size()} cross {rr.cross_rank()}/{rr.cross_size()} "
                         f"sum {total:g} pid {os.getpid()}\n")
        sys.stdout.flush()
        print(f"stderr of rank {rr.rank()}", file=sys.stderr)
        rr.shutdown()
    elif mode == "fail":
        pids()
        if rank == int(args[0]):
            time.sleep(0.3)
            sys.exit(int(args[1]))
        time.sleep(120)
    elif mode in ("sleep", "ignore-term"):
        if mode == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pids()
        time.sleep(120)
    elif mode in ("settings", "stall"):
        settings_or_stall(mode)
    elif mode == "autotune":
        autotune()
    elif mode == "env":
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "RINGREDUCE_HOST_ID", "OMPI_COMM_WORLD_SIZE", "RR_EXTRA")
        print(" ".join(f"{n}={os.environ.get(n, '-')}" for n in names))
        print(f"secret {len(os.environ.get('RINGREDUCE_SECRET', ''))}")


main()
