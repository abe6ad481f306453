"""The autotuner against the defaults and against MPI, on a gradient step (numpy, under MPI).

    python benchmarks/autotune.py                       # -np 2, three interleaved rounds
    python benchmarks/autotune.py --np 3 --repeats 2 --scale 1 --autotune-trials 10

A step hands ResNet-50's 161 gradients (``train_step.resnet50_shapes``, 25.6 M float32 at
``--scale 1``) to the library in backward order, fc first, writing each gradient just before
it goes (as backward does; ``--touch-us`` of extra work per tensor stands in for the compute
between gradients), then waits for all of them. Each configuration is a fresh
``mpirun -np N`` launch, interleaved in rotating order over ``--repeats`` rounds:

* ``defaults``: ringreduce as configured out of the box;
* ``autotune``: ``RINGREDUCE_AUTOTUNE=1`` (Horovod's ``HOROVOD_AUTOTUNE``) with its default
  search (3 warmup trials, 20 scored, 5 samples of 10 steps each) unless
  ``--autotune-steps`` / ``--autotune-trials`` shrink it; the tuning steps are reported apart,
  then ``--steps`` steps are timed with the chosen settings;
* ``mpi``: the same step with ``MPI_Iallreduce`` per gradient (mpi4py) and ``Waitall``.

Columns follow nccl-tests: size = bytes per step, time = median step after tuning, algbw =
size / time, busbw = algbw * 2(N-1)/N; ``tuning`` = steps spent tuning and their mean time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ a rank
def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, HERE)
    from train_step import resnet50_shapes

    comm = MPI.COMM_WORLD
    shapes = [(n, max(1, int(np.prod(s) * args.scale))) for n, s in resnet50_shapes()][::-1]
    grads = [np.zeros(k, np.float32) for _, k in shapes]
    value = np.float32(comm.Get_rank() + 1)
    touch = args.touch_us * 1e-6

    def write(g):
        g.fill(value)
        end = time.perf_counter() + touch
        while time.perf_counter() < end:
            pass

    if args.worker == "mpi":
        def step():
            reqs = []
            for g in grads:
                write(g)
                reqs.append(comm.Iallreduce(MPI.IN_PLACE, g, op=MPI.SUM))
            MPI.Request.Waitall(reqs)
        tuning = lambda: False  # noqa: E731
    else:
        import ringreduce as rr

        rr.init()
        stats = rr._comm()._engine.stats

        def step():
            hs = []
            for (name, _), g in zip(shapes, grads):
                write(g)
                hs.append(rr.allreduce_async_(g, op=rr.Sum, name=name))
            for h in hs:
                rr.synchronize(h)
        tuning = lambda: stats()["autotuning"]  # noqa: E731

    step()
    expect = comm.Get_size() * (comm.Get_size() + 1) / 2
    if not all((g == expect).all() for g in grads):
        raise SystemExit(f"rank {comm.Get_rank()}: wrong sums")
    tune_times: list[float] = []
    while tuning() and len(tune_times) < args.max_tuning_steps:
        t = time.perf_counter()
        step()
        tune_times.append(time.perf_counter() - t)
    times = []
    for _ in range(args.steps):
        comm.Barrier()
        t = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    if comm.Get_rank() == 0:
        out = {"step_s": statistics.median(times), "tuning_steps": len(tune_times),
               "tuning_s": statistics.mean(tune_times) if tune_times else 0.0,
               "bytes": 4 * sum(k for _, k in shapes)}
        if args.worker != "mpi":
            s = stats()
            out["chosen"] = {k: s[k] for k in ("fusion_threshold", "cycle_time_ms", "batch_us",
                                               "hierarchical", "autotuning")}
        print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------ the driver
def configs(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    tune = {"RINGREDUCE_AUTOTUNE": "1"}
    if args.autotune_steps:
        tune["RINGREDUCE_AUTOTUNE_STEPS_PER_SAMPLE"] = str(args.autotune_steps)
    if args.autotune_trials:
        tune["RINGREDUCE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"] = str(args.autotune_trials)
    return [("defaults", "rr", {}), ("autotune", "rr", tune), ("mpi", "mpi", {})]


def launch(args: argparse.Namespace, kind: str, extra: dict) -> dict:
    env = {**os.environ, **extra, "OMP_NUM_THREADS": "1"}
    cmd = ["mpirun", "-np", str(args.np), sys.executable, os.path.abspath(__file__),
           "--worker", kind, "--scale", str(args.scale), "--steps", str(args.steps),
           "--touch-us", str(args.touch_us), "--max-tuning-steps", str(args.max_tuning_steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def report(args: argparse.Namespace, results: dict) -> None:
    n = args.np
    print(f"\n-np {n}, {len(next(iter(results.values())))} launches per row, scale {args.scale}, "
          f"touch {args.touch_us} us per gradient; medians (min-max) over launches")
    print("| config | size | time (ms) | algbw (GB/s) | busbw (GB/s) | tuning steps | "
          "tuning step (ms) | chosen: fusion MiB, cycle ms, batch us, hierarchical |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        t = [r["step_s"] for r in runs]
        med = statistics.median(t)
        size = runs[0]["bytes"]
        alg = size / med / 1e9
        tuning = [r["tuning_steps"] for r in runs]
        tuning_ms = statistics.median([r["tuning_s"] for r in runs]) * 1e3
        chosen = "; ".join(
            f"{c['fusion_threshold'] / 2**20:.3g}, {c['cycle_time_ms']:.2g}, "
            f"{c['batch_us']:.0f}, {'auto' if c['hierarchical'] < 0 else c['hierarchical']}"
            for c in (r.get("chosen") for r in runs) if c) or "-"
        print(f"| {name} | {size / 2**20:.1f} MiB | {med * 1e3:.1f} ({min(t) * 1e3:.1f}-"
              f"{max(t) * 1e3:.1f}) | {alg:.2f} | {alg * 2 * (n - 1) / n:.2f} | "
              f"{statistics.median(tuning):.0f} | {tuning_ms:.1f} | {chosen} |")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("rr", "mpi"), help=argparse.SUPPRESS)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of launches")
    p.add_argument("--scale", type=float, default=0.25, help="multiply every gradient's size")
    p.add_argument("--steps", type=int, default=30, help="timed steps after tuning")
    p.add_argument("--touch-us", type=float, default=20.0, help="extra work per gradient")
    p.add_argument("--autotune-steps", type=int, default=0, help="steps per sample (10)")
    p.add_argument("--autotune-trials", type=int, default=0, help="scored trials (20)")
    p.add_argument("--max-tuning-steps", type=int, default=5000)
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    todo = configs(args)
    results: dict = {name: [] for name, _, _ in todo}
    for r in range(args.repeats):
        for name, kind, extra in todo[r % len(todo):] + todo[:r % len(todo)]:
            results[name].append(launch(args, kind, extra))
            print(f"# round {r + 1} {name}: {json.dumps(results[name][-1])}", flush=True)
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
