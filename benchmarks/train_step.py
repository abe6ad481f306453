"""Training-step benchmark: a ResNet-50 gradient list reduced per step, three ways.

Run under MPI (mpi4py bootstraps the peers and gathers timings); any rank count works, 1 too::

    mpirun -np 2 python benchmarks/train_step.py
    mpirun -np 2 python benchmarks/train_step.py --scale 0.2 --steps 20 --csv step.csv
    RINGREDUCE_FUSION_THRESHOLD=268435456 mpirun -np 2 python benchmarks/train_step.py

The gradients are those of torchvision's ResNet-50 (161 float32 tensors, 25,557,032
parameters: every conv weight, every BatchNorm weight/bias pair, fc weight and bias), built
from the layer shapes, so a few tensors are several MB and most are a few KB. ``--scale``
multiplies every tensor's element count (at least 1 element) for quicker runs.

One step, per implementation, each on its own buffers:

* ``ringreduce``: ``rr.allreduce_async_(g, op=rr.Sum, name=f"grad.{i}")`` for every tensor in
  backward order (fc first, conv1 last), then ``rr.synchronize`` on every handle;
* ``rr-shared-grads``: the same step, the gradients being views of one ``rr.shared_zeros``
  buffer (laid out in order, as a framework holding its gradients in one flat buffer would), so
  the fused allreduce reads the peers' gradients where they lie (one host only; elsewhere it is
  the ring again);
* ``mpi-loop``: ``MPI_Allreduce(MPI_IN_PLACE, g)`` for each tensor (off with ``--no-mpi-loop``);
* with ``--breakdown``, three more ringreduce rows that take a step's costs away one at a
  time: ``rr-grouped`` (one ``grouped_allreduce_`` of the same separate arrays: no per-tensor
  submits, one response), ``rr-grouped-views`` (the same, the tensors being views of one
  array) and ``rr-one-array`` (one ``allreduce_`` of one array of the total size);
* ``mpi-packed``: one ``MPI_Allreduce(MPI_IN_PLACE, flat)`` of a buffer of the total size,
  packing not counted (the ideal a fusing engine tries to reach).

Before timing, each implementation runs once on rank-dependent integer-valued inputs (so float
sums are exact in any order) and must match a per-tensor MPI reference exactly. Timing is on
zeros. Steps are interleaved (the order of the implementations rotates every round), each
preceded by a barrier; after ``--warmup`` rounds, ``--steps`` rounds are timed. Per step the time
is the maximum over ranks; the table shows its median and 90th percentile, algbw (total gradient
bytes / median time) and speedups (other's median time / this one's) against the per-tensor
loop and the pre-packed buffer, then the issue's targets with PASS/MISS.

Last, with ringreduce initialized and idle, each rank sleeps ``--idle-seconds`` and reports the
process CPU time (all threads) it used meanwhile, as a percentage of one core: the cost of any
background engine thread while there is nothing to do (target < 1%).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from bench_common import init_ringreduce
from mpi4py import MPI

import ringreduce as rr

COMM = MPI.COMM_WORLD
RR, LOOP, PACKED = "ringreduce", "mpi-loop", "mpi-packed"
#: ringreduce's step with the gradients laid out in one shared buffer (``rr.shared_zeros``).
RR_SHARED = "rr-shared-grads"
#: --breakdown: the same bytes through ringreduce without a step's costs, one at a time.
RR_GROUPED, RR_VIEWS, RR_ONE = "rr-grouped", "rr-grouped-views", "rr-one-array"
#: Implementations whose buffers are one flat array.
FLAT = (PACKED, RR_ONE)
#: Settings that shape the engine's behaviour on this benchmark; always printed (or "unset").
ENGINE_ENV = (
    "RINGREDUCE_FUSION_THRESHOLD",
    "RINGREDUCE_CYCLE_TIME_MS",
    "RINGREDUCE_CACHE_CAPACITY",
)
#: Issue 3 targets: speedup over the per-tensor loop; time relative to the packed buffer; idle %.
TARGET_VS_LOOP, TARGET_VS_PACKED, TARGET_IDLE_PCT = 2.0, 1.10, 1.0

#: One step of an implementation: sums its own buffers over all ranks, in place.
StepFn = Callable[[], None]


@dataclass
class Summary:
    """Per-step times of one implementation, each already the maximum over ranks."""

    impl: str
    times_s: np.ndarray

    @property
    def median(self) -> float:
        return float(np.median(self.times_s))

    @property
    def p90(self) -> float:
        return float(np.percentile(self.times_s, 90))


# --------------------------------------------------------------------------- the gradient list


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of torchvision's ResNet-50, in ``named_parameters()`` order.

    Bottleneck blocks (1x1, 3x3, 1x1 convs, expansion 4), layers of 3, 4, 6, 3 blocks; the first
    block of each layer has a 1x1 downsample conv + BatchNorm. Convs have no bias.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def conv_bn(prefix: str, conv: str, bn: str, cout: int, cin: int, k: int) -> None:
        shapes.append((f"{prefix}{conv}.weight", (cout, cin, k, k)))
        shapes.append((f"{prefix}{bn}.weight", (cout,)))
        shapes.append((f"{prefix}{bn}.bias", (cout,)))

    conv_bn("", "conv1", "bn1", 64, 3, 7)
    cin = 64
    for layer, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}."
            conv_bn(p, "conv1", "bn1", width, cin, 1)
            conv_bn(p, "conv2", "bn2", width, width, 3)
            conv_bn(p, "conv3", "bn3", 4 * width, width, 1)
            if b == 0:
                conv_bn(p, "downsample.0", "downsample.1", 4 * width, cin, 1)
            cin = 4 * width
    shapes.append(("fc.weight", (1000, cin)))
    shapes.append(("fc.bias", (1000,)))
    return shapes


def gradient_sizes(scale: float) -> list[tuple[str, int]]:
    """(name, element count) of every gradient, forward order, counts scaled (at least 1)."""
    return [(name, max(1, round(int(np.prod(s)) * scale))) for name, s in resnet50_shapes()]


def describe(sizes: Sequence[tuple[str, int]], scale: float) -> list[str]:
    """Header lines about the gradient list: count, total, largest, how many are small."""
    counts = np.array([n for _, n in sizes])
    nbytes = counts * 4
    big = int(np.argmax(counts))
    small = nbytes < (64 << 10)
    return [
        f"# gradients: ResNet-50 x scale {scale:g}: {len(sizes)} float32 tensors, "
        f"{int(counts.sum()):,} parameters, {human(int(nbytes.sum()))}",
        f"#   largest {human(int(nbytes[big]))} ({sizes[big][0]}), smallest "
        f"{human(int(nbytes.min()))}, median {human(float(np.median(nbytes)))}; "
        f"{int(small.sum())} tensors < 64 KiB hold {100 * nbytes[small].sum() / nbytes.sum():.1f}%"
        " of the bytes",
    ]


def human(nbytes: float) -> str:
    """Format a byte count with binary units, e.g. ``256 B``, ``8.0 MiB``."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


# --------------------------------------------------------------------------- implementations


def rr_step(grads: Sequence[np.ndarray]) -> StepFn:
    """ringreduce: async submit in backward order (last layer first), then wait for all."""
    order = list(reversed(list(enumerate(grads))))

    def step() -> None:
        handles = [rr.allreduce_async_(g, op=rr.Sum, name=f"grad.{i}") for i, g in order]
        for h in handles:
            rr.synchronize(h)

    return step


def rr_grouped_step(grads: Sequence[np.ndarray]) -> StepFn:
    """ringreduce: one ``grouped_allreduce_`` of every tensor (one response, one submit)."""

    def step() -> None:
        rr.grouped_allreduce_(list(grads), op=rr.Sum, name="grads")

    return step


def rr_one_array_step(flat: np.ndarray) -> StepFn:
    """ringreduce: one ``allreduce_`` of a single array holding every gradient."""

    def step() -> None:
        rr.allreduce_(flat, op=rr.Sum, name="flat")

    return step


def mpi_loop_step(grads: Sequence[np.ndarray]) -> StepFn:
    """One in-place MPI_Allreduce per tensor (forward order, as a naive loop would)."""

    def step() -> None:
        for g in grads:
            COMM.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)

    return step


def mpi_packed_step(flat: np.ndarray) -> StepFn:
    """One in-place MPI_Allreduce of a pre-packed buffer holding every gradient."""

    def step() -> None:
        COMM.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    return step


def make_buffers(
    counts: Sequence[int], with_loop: bool, breakdown: bool = False
) -> tuple[dict[str, StepFn], dict[str, list[np.ndarray]]]:
    """Allocate each implementation's own zeroed buffers and its step function.

    Separate buffers keep one implementation from finding the previous one's data in cache.
    With ``breakdown``, three more ringreduce rows take a step's costs away one at a time:
    the per-tensor submits (``rr-grouped``), the separate arrays (``rr-grouped-views``: the
    tensors are views of one array) and the tensor boundaries (``rr-one-array``).

    Returns
    -------
    steps : dict of str to callable
        Implementation name to one step, ringreduce first.
    buffers : dict of str to list of numpy.ndarray
        Implementation name to its gradients (for ``mpi-packed``, the one flat buffer).
    """
    buffers = {RR: [np.zeros(n, np.float32) for n in counts]}
    steps = {RR: rr_step(buffers[RR])}
    shared = rr.shared_zeros(int(sum(counts)), np.float32)
    buffers[RR_SHARED] = [shared[e - n : e] for n, e in zip(counts, np.cumsum(counts))]
    steps[RR_SHARED] = rr_step(buffers[RR_SHARED])
    if with_loop:
        buffers[LOOP] = [np.zeros(n, np.float32) for n in counts]
        steps[LOOP] = mpi_loop_step(buffers[LOOP])
    if breakdown:
        buffers[RR_GROUPED] = [np.zeros(n, np.float32) for n in counts]
        steps[RR_GROUPED] = rr_grouped_step(buffers[RR_GROUPED])
        whole = np.zeros(int(sum(counts)), np.float32)
        ends = np.cumsum(counts)
        buffers[RR_VIEWS] = [whole[e - n : e] for n, e in zip(counts, ends)]
        steps[RR_VIEWS] = rr_grouped_step(buffers[RR_VIEWS])
        buffers[RR_ONE] = [np.zeros(int(sum(counts)), np.float32)]
        steps[RR_ONE] = rr_one_array_step(buffers[RR_ONE][0])
    buffers[PACKED] = [np.zeros(int(sum(counts)), np.float32)]
    steps[PACKED] = mpi_packed_step(buffers[PACKED][0])
    return steps, buffers


# --------------------------------------------------------------------------- measuring


def check(steps: dict[str, StepFn], buffers: dict[str, list[np.ndarray]]) -> dict[str, bool]:
    """Run each implementation once on the same inputs; compare with a per-tensor MPI result.

    Rank ``r`` contributes ``(j + 3 i) % 11 + r + 1`` at element ``j`` of tensor ``i``: small
    integers, so float32 sums are exact whatever the reduction order, and results must be equal
    bit for bit. The reference is also checked against the closed form. Buffers are zeroed after.

    Returns
    -------
    dict of str to bool
        Per implementation (and ``mpi-reference``), True when exact on every rank.
    """
    n, r = COMM.Get_size(), COMM.Get_rank()
    bases = [((np.arange(g.size) + 3 * i) % 11).astype(np.float32) for i, g in
             enumerate(buffers[RR])]
    inputs = [b + (r + 1) for b in bases]
    ref = [x.copy() for x in inputs]
    for x in ref:
        COMM.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    ok = {"mpi-reference": all(np.array_equal(x, n * b + n * (n + 1) // 2)
                               for x, b in zip(ref, bases))}
    for name, bufs in buffers.items():
        if name in FLAT:
            np.concatenate(inputs, out=bufs[0])
            steps[name]()
            ok[name] = bool(np.array_equal(bufs[0], np.concatenate(ref)))
        else:
            for g, x in zip(bufs, inputs):
                np.copyto(g, x)
            steps[name]()
            ok[name] = all(np.array_equal(g, x) for g, x in zip(bufs, ref))
        for g in bufs:
            g.fill(0)  # time on zeros: repeated in-place sums of anything else grow
    return {k: bool(COMM.allreduce(v, op=MPI.LAND)) for k, v in ok.items()}


def run_steps(steps: dict[str, StepFn], warmup: int, timed: int) -> list[Summary]:
    """Interleave the implementations step by step; per-step times, max over ranks.

    Round ``k`` runs every implementation once, in an order rotated by ``k`` so that none
    always follows the same other one. Each step is barrier, then the timed step.
    """
    names = list(steps)
    local = {name: np.empty(timed) for name in names}
    for k in range(warmup + timed):
        order = names[k % len(names) :] + names[: k % len(names)]
        for name in order:
            COMM.Barrier()
            t0 = time.perf_counter()
            steps[name]()
            dt = time.perf_counter() - t0
            if k >= warmup:
                local[name][k - warmup] = dt
    out = []
    for name in names:
        worst = np.empty(timed)
        COMM.Allreduce(local[name], worst, op=MPI.MAX)
        out.append(Summary(name, worst))
    return out


def thread_count() -> int:
    """Native threads in this process (0 when /proc is not available)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def idle_cpu_percent(seconds: float) -> list[tuple[float, int]]:
    """Per rank: process CPU time (all threads) over ``seconds`` of sleep, % of one core.

    All ranks sleep at the same time with ringreduce initialized and nothing submitted, so this
    is what a background engine costs between steps. Collective; the list (one ``(percent,
    native thread count)`` per rank) is returned on every rank.
    """
    COMM.Barrier()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return COMM.allgather((100.0 * cpu / wall, thread_count()))


# --------------------------------------------------------------------------- reporting


def env_settings() -> list[tuple[str, str]]:
    """The engine settings above (value or ``unset``), then any other ``RINGREDUCE_*`` set."""
    rest = sorted(k for k in os.environ if k.startswith("RINGREDUCE_") and k not in ENGINE_ENV)
    return [(k, os.environ.get(k, "unset")) for k in ENGINE_ENV] + [
        (k, os.environ[k]) for k in rest
    ]


def header_lines(args: argparse.Namespace) -> list[str]:
    """Versions, world size, settings and timing method, printed above the table."""
    import mpi4py

    lib = MPI.Get_library_version().splitlines()[0].strip()
    env = ", ".join(f"{k}={v}" for k, v in env_settings())
    return [
        f"# python {platform.python_version()}, numpy {np.__version__}, mpi4py "
        f"{mpi4py.__version__}, MPI {'.'.join(map(str, MPI.Get_version()))}: {lib}",
        f"# ringreduce {getattr(rr, '__version__', '?')}: world size {rr.size()}, "
        f"local size {rr.local_size()}; MPI world size {COMM.Get_size()}",
        f"# env (rank 0): {env}",
        f"# float32 sum, in place; {args.warmup} warm-up + {args.steps} timed steps per "
        "implementation, interleaved; step time = max over ranks",
    ]


def speedup(base: Optional[Summary], s: Summary) -> str:
    """``base`` median time over ``s``'s, formatted (``-`` without a base)."""
    return "-" if base is None else f"{base.median / s.median:.2f}x"


def table(results: Sequence[Summary], nbytes: int) -> list[str]:
    """The results table: one row per implementation."""
    by = {s.impl: s for s in results}
    lines = [
        f"{'impl':<16} {'median ms':>10} {'p90 ms':>9} {'algbw GB/s':>11} "
        f"{'vs ' + LOOP:>12} {'vs ' + PACKED:>14}"
    ]
    for s in results:
        lines.append(
            f"{s.impl:<16} {s.median * 1e3:>10.2f} {s.p90 * 1e3:>9.2f} "
            f"{nbytes / s.median / 1e9:>11.2f} {speedup(by.get(LOOP), s):>12} "
            f"{speedup(by[PACKED], s):>14}"
        )
    lines.append("# vs X = X's median time / this one's (> 1: faster than X)")
    if COMM.Get_size() == 1:
        lines.append("# world size 1: MPI's in-place allreduce does nothing; ratios mean little")
    return lines


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def target_lines(results: Sequence[Summary], idle: Sequence[tuple[float, int]]) -> list[str]:
    """Issue 3's targets against this run's medians and idle measurement."""
    by = {s.impl: s for s in results}
    mine, packed = by[RR], by[PACKED]
    lines = []
    if LOOP in by:
        x = by[LOOP].median / mine.median
        lines.append(
            f"# target: {RR} >= {TARGET_VS_LOOP:g}x faster than {LOOP}: {x:.2f}x  "
            f"{verdict(x >= TARGET_VS_LOOP)}"
        )
    if LOOP in by and RR_SHARED in by:
        lines.append(f"# (not a target) {RR_SHARED} vs {LOOP}: "
                     f"{by[LOOP].median / by[RR_SHARED].median:.2f}x")
    rel = mine.median / packed.median
    lines.append(
        f"# target: {RR} time <= {TARGET_VS_PACKED:.2f}x {PACKED}'s: {rel:.2f}x  "
        f"{verdict(rel <= TARGET_VS_PACKED)}"
    )
    worst = max(p for p, _ in idle)
    lines.append(
        f"# target: idle CPU < {TARGET_IDLE_PCT:g}% of one core on every rank: max "
        f"{worst:.2f}%  {verdict(worst < TARGET_IDLE_PCT)}"
    )
    return lines


def write_csv(
    path: str,
    results: Sequence[Summary],
    args: argparse.Namespace,
    counts: Sequence[int],
    idle: Sequence[tuple[float, int]],
) -> None:
    """One row per implementation, with the run's settings so sweeps can be concatenated."""
    nbytes = 4 * int(sum(counts))
    by = {s.impl: s for s in results}
    env = env_settings()
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["impl", "world_size", "scale", "tensors", "bytes", "steps", "warmup"]
            + ["median_ms", "p90_ms", "min_ms", "algbw_GBps", "speedup_vs_mpi_loop"]
            + ["speedup_vs_mpi_packed", "idle_cpu_pct_max"]
            + [k for k, _ in env]
        )
        for s in results:
            loop = by.get(LOOP)
            w.writerow(
                [s.impl, COMM.Get_size(), args.scale, len(counts), nbytes, args.steps]
                + [args.warmup, f"{s.median * 1e3:.4f}", f"{s.p90 * 1e3:.4f}"]
                + [f"{s.times_s.min() * 1e3:.4f}", f"{nbytes / s.median / 1e9:.4f}"]
                + ["" if loop is None else f"{loop.median / s.median:.4f}"]
                + [f"{by[PACKED].median / s.median:.4f}", f"{max(p for p, _ in idle):.4f}"]
                + [v for _, v in env]
            )


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags (``argv`` without the program name; None: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per implementation (20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply tensor sizes by this (1)")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="idle measurement (3)")
    p.add_argument("--no-mpi-loop", action="store_true", help="skip the per-tensor MPI loop")
    p.add_argument("--breakdown", action="store_true",
                   help="add rr-grouped, rr-grouped-views and rr-one-array rows")
    p.add_argument("--csv", metavar="PATH", help="write one row per implementation here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.scale <= 0 or args.idle_seconds <= 0:
        p.error("need --steps >= 1, --warmup >= 0, --scale > 0, --idle-seconds > 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Check, time, measure idle cost; print (and optionally write CSV) on rank 0.

    Returns
    -------
    int
        Process exit status: 0, or 1 when any implementation returned a wrong sum.
    """
    args = parse_args(argv)
    root, say = init_ringreduce(COMM)
    start = time.perf_counter()
    for line in header_lines(args):
        say(line, flush=True)

    sizes = gradient_sizes(args.scale)
    counts = [n for _, n in sizes]
    for line in describe(sizes, args.scale):
        say(line, flush=True)
    steps, buffers = make_buffers(counts, with_loop=not args.no_mpi_loop,
                                  breakdown=args.breakdown)
    ok = check(steps, buffers)
    say("# check (same inputs, exact): "
        + ", ".join(f"{k} {'OK' if v else 'WRONG'}" for k, v in ok.items()), flush=True)

    results = run_steps(steps, args.warmup, args.steps)
    for line in table(results, 4 * int(sum(counts))):
        say(line, flush=True)

    idle = idle_cpu_percent(args.idle_seconds)
    say(f"# idle ({args.idle_seconds:g} s asleep, ringreduce initialized): process CPU time as "
        "% of one core, per rank: "
        + ", ".join(f"rank {i} {p:.2f}% ({t} threads)" for i, (p, t) in enumerate(idle)))
    for line in target_lines(results, idle):
        say(line)
    say(f"# total time {time.perf_counter() - start:.1f} s")
    if root and args.csv:
        write_csv(args.csv, results, args, counts, idle)
        say(f"# wrote {args.csv}")
    COMM.Barrier()
    rr.shutdown()
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
