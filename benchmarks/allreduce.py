"""In-place allreduce benchmark: ringreduce against MPI_Allreduce and torch.distributed gloo.

Run under MPI (mpi4py bootstraps the peers and gathers timings)::

    mpirun -np 2 python benchmarks/allreduce.py
    mpirun -np 2 python benchmarks/allreduce.py --max-bytes 16M --plot busbw.png --csv out.csv
    mpirun -np 2 python benchmarks/allreduce.py --shared --peers mpi   # + rr.shared_zeros column
    mpirun -np 2 python benchmarks/allreduce.py --out-of-place --peers mpi --min-bytes 1M

Timing follows nccl-tests: for each size, every implementation works on the same buffer in
place; a timed block is barrier, warmup iterations, barrier, then ``iters`` back-to-back calls.
Each rank takes the median per-iteration time over ``--reps`` blocks, and the reported time is the
maximum of that over ranks. With ``--shared`` a ``rr-shared`` column times ringreduce on a buffer
from ``rr.shared_zeros`` (its own buffer; the others share one private buffer), which takes the
shared-buffer path on one host; it is a ringreduce variant, not a peer, so the ratio columns
leave it out. With ``--out-of-place`` a ``rr-oop`` column times ``rr.allreduce(buf)`` (a new
array each call, dropped at once, as a training loop drops last step's result) on the same
buffer as the in-place ``ringreduce`` column, and a line per size from 1 MiB up gives its time
over the in-place call's (issue 20's target: at most 1.2). Implementations are interleaved
within each size (and their order rotated between repetitions) so that noise on a small machine
hits them all alike. Iteration counts shrink with size so the whole default sweep stays within a
few minutes on 2 cores.

algbw = bytes / time; busbw = algbw * 2 (n - 1) / n, the per-link traffic of a bandwidth-optimal
allreduce, comparable across rank counts and with the memcpy bandwidth printed as a ceiling.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from bench_common import init_ringreduce
from mpi4py import MPI

import ringreduce as rr

COMM = MPI.COMM_WORLD
RR = "ringreduce"
RR_SHARED = "rr-shared"  # ringreduce on a shared buffer (--shared)
RR_OOP = "rr-oop"  # ringreduce out of place: a new array per call (--out-of-place)
VARIANTS = (RR, RR_SHARED, RR_OOP)  # ringreduce's own columns; the rest are peers
#: Issue 20: out-of-place time / in-place time, from 1 MiB up.
TARGET_OOP, OOP_FROM = 1.2, 1 << 20
PEERS = ("mpi", "gloo")
DTYPES = ("float32", "float64", "int32", "int64")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

#: An allreduce under test: sums the given buffer over all ranks, in place.
AllreduceFn = Callable[[np.ndarray], None]


@dataclass
class Result:
    """Timing and check of one implementation at one size."""

    impl: str
    nbytes: int
    count: int
    iters: int
    time_s: float  # per iteration: max over ranks of the median over repetitions
    correct: bool
    busbw_factor: float = field(repr=False)

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.time_s / 1e9

    @property
    def busbw(self) -> float:
        """Bus bandwidth in GB/s: ``algbw * 2 (n - 1) / n``."""
        return self.algbw * self.busbw_factor


def parse_bytes(text: str) -> int:
    """Parse a byte count such as ``4``, ``64K``, ``256M``, ``1GiB`` (binary units).

    Parameters
    ----------
    text : str
        The count, optionally followed by K, M or G and an optional ``B``/``iB``.

    Returns
    -------
    int
        Number of bytes.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 4, 64K, 256M)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def human(nbytes: float) -> str:
    """Format a byte count with binary units, e.g. ``4 B``, ``64 KiB``, ``256 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns
    -------
    argparse.Namespace
        The parsed flags, ``peers`` as a list of names.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=4, help="smallest size (4)")
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="largest size (256M)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows (4)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type (float32)")
    p.add_argument("--iters", type=int, default=100, help="timed iterations at small sizes (100)")
    p.add_argument("--warmup", type=int, default=10, help="warmup iterations at small sizes (10)")
    p.add_argument("--reps", type=int, default=5, help="timed blocks per size; median taken (5)")
    p.add_argument(
        "--budget",
        type=parse_bytes,
        default=256 << 20,
        help="bytes per timed block: iters = min(--iters, budget / size), at least 1 (256M)",
    )
    p.add_argument("--peers", default="mpi,gloo", help="comma list from: mpi, gloo ('' = none)")
    p.add_argument("--shared", action="store_true",
                   help="add an rr-shared column: ringreduce on an rr.shared_zeros buffer")
    p.add_argument("--out-of-place", action="store_true",
                   help="add an rr-oop column: rr.allreduce returning a new array")
    p.add_argument("--plot", metavar="PNG", help="write a busbw-vs-size plot here")
    p.add_argument("--csv", metavar="CSV", help="write one row per size and implementation here")
    args = p.parse_args(argv)
    args.peers = [s for s in (x.strip() for x in args.peers.split(",")) if s]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        p.error(f"unknown --peers {unknown}; choose from {list(PEERS)}")
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    if min(args.iters, args.reps) < 1 or args.warmup < 0:
        p.error("need --iters >= 1, --reps >= 1, --warmup >= 0")
    return args


def sizes(min_bytes: int, max_bytes: int, factor: int, itemsize: int) -> list[int]:
    """Byte sizes of the sweep, each a whole number of elements.

    Parameters
    ----------
    min_bytes, max_bytes : int
        Inclusive range.
    factor : int
        Ratio between consecutive sizes.
    itemsize : int
        Element size; sizes are rounded up to a multiple of it.

    Returns
    -------
    list of int
        Increasing, de-duplicated sizes in bytes.
    """
    out: list[int] = []
    n = min_bytes
    while n <= max_bytes:
        rounded = -(-n // itemsize) * itemsize
        if rounded <= max_bytes and (not out or rounded > out[-1]):
            out.append(rounded)
        n *= factor
    return out


def iterations(nbytes: int, cap: int, budget: int) -> int:
    """Scale an iteration count down with size: ``min(cap, budget // nbytes)``, at least 1."""
    return max(1, min(cap, budget // nbytes))


# --------------------------------------------------------------------------- implementations


def rr_allreduce(buf: np.ndarray) -> None:
    """ringreduce, in place."""
    rr.allreduce_(buf, op=rr.Sum)


def mpi_allreduce(buf: np.ndarray) -> None:
    """MPI_Allreduce with MPI_IN_PLACE via mpi4py."""
    COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def master_address() -> str:
    """Address other ranks can reach rank 0 at: $MASTER_ADDR, loopback on one node, else host."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = local.Get_size() == COMM.Get_size()
    local.Free()
    return "127.0.0.1" if one_node else socket.gethostbyname(socket.gethostname())


def free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago (rank 0 only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def setup_gloo() -> tuple[Optional[AllreduceFn], str]:
    """Start a torch.distributed gloo group over the MPI ranks, if torch is importable.

    Rank 0 chooses the rendezvous address and port and broadcasts them with mpi4py. Every rank
    must call this (it is collective), and all get the same outcome.

    Returns
    -------
    fn : callable or None
        The gloo allreduce, or None when torch is missing on any rank.
    note : str
        torch version, or why gloo is skipped.
    """
    try:
        import torch
        import torch.distributed as dist

        note = f"torch {torch.__version__}"
        ok = dist.is_available() and dist.is_gloo_available()
    except ImportError as e:
        ok, note = False, f"torch not importable ({e})"
    if not COMM.allreduce(ok, op=MPI.LAND):
        return None, note if not ok else "torch/gloo missing on some rank"

    addr = master_address()
    port = free_port(addr) if COMM.Get_rank() == 0 else 0
    addr, port = COMM.bcast((addr, port), root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=COMM.Get_rank(),
        world_size=COMM.Get_size(),
    )

    def gloo_allreduce(buf: np.ndarray) -> None:
        dist.all_reduce(torch.from_numpy(buf), op=dist.ReduceOp.SUM)

    return gloo_allreduce, note


def rr_out_of_place(buf: np.ndarray) -> None:
    rr.allreduce(buf, op=rr.Sum)  # the new array is dropped (its memory goes back to the pool)


def rr_out_of_place_checked(buf: np.ndarray) -> None:
    np.copyto(buf, rr.allreduce(buf, op=rr.Sum))


#: What check() runs instead of an implementation that leaves its result elsewhere.
_CHECKED = {RR_OOP: rr_out_of_place_checked}


def implementations(peers: Sequence[str], shared: bool = False,
                    out_of_place: bool = False) -> tuple[dict[str, AllreduceFn], list[str]]:
    """The implementations to time, ringreduce first, and notes for the header.

    Parameters
    ----------
    peers : sequence of str
        Baselines requested on the command line.
    shared : bool
        Also time ringreduce on a shared buffer (``rr-shared``).
    out_of_place : bool
        Also time ringreduce's out-of-place call (``rr-oop``).

    Returns
    -------
    impls : dict of str to callable
        Name to in-place sum allreduce.
    notes : list of str
        Versions, and peers that were skipped and why.
    """
    impls: dict[str, AllreduceFn] = {RR: rr_allreduce}
    if shared:
        impls[RR_SHARED] = rr_allreduce
    if out_of_place:
        impls[RR_OOP] = rr_out_of_place
    notes = []
    if "mpi" in peers:
        impls["mpi"] = mpi_allreduce
    if "gloo" in peers:
        fn, note = setup_gloo()
        notes.append(f"gloo: {note}" + ("" if fn else " -> skipped"))
        if fn is not None:
            impls["gloo"] = fn
    return impls, notes


# --------------------------------------------------------------------------- measuring


def check(fn: AllreduceFn, buf: np.ndarray) -> bool:
    """Run ``fn`` once on rank-dependent data and verify the sum on every rank.

    Rank ``r`` contributes ``(r + 1) * (i % 7 + 1)`` at element ``i``; the sums are small
    integers, exact in every supported dtype.

    Returns
    -------
    bool
        True when the result is exact on all ranks.
    """
    n = COMM.Get_size()
    pattern = (np.arange(buf.size) % 7 + 1).astype(buf.dtype)
    np.multiply(pattern, COMM.Get_rank() + 1, out=buf)
    fn(buf)
    ok = bool(np.array_equal(buf, pattern * (n * (n + 1) // 2)))
    return bool(COMM.allreduce(ok, op=MPI.LAND))


def timed_block(fn: AllreduceFn, buf: np.ndarray, warmup: int, iters: int) -> float:
    """Seconds per iteration on this rank: barrier, warmup, barrier, ``iters`` timed calls."""
    COMM.Barrier()
    for _ in range(warmup):
        fn(buf)
    COMM.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(buf)
    return (time.perf_counter() - t0) / iters


def measure_size(
    impls: dict[str, AllreduceFn], nbytes: int, dtype: np.dtype, args: argparse.Namespace
) -> list[Result]:
    """Check and time every implementation at one size, interleaved.

    Parameters
    ----------
    impls : dict of str to callable
        Implementations to compare.
    nbytes : int
        Buffer size in bytes (a multiple of the item size).
    dtype : numpy.dtype
        Element type.
    args : argparse.Namespace
        Iteration settings.

    Returns
    -------
    list of Result
        One per implementation, in ``impls`` order; identical on every rank.
    """
    count = nbytes // dtype.itemsize
    private = np.empty(count, dtype=dtype)
    bufs = {name: rr.shared_zeros(count, dtype) if name == RR_SHARED else private
            for name in impls}
    correct = {name: check(_CHECKED.get(name, fn), bufs[name]) for name, fn in impls.items()}
    # Time on zeros: repeated in-place sums of anything else grow without bound (overflow to
    # inf in float32 after ~100 iterations at 2 ranks), and zeros cost the same to add.
    for buf in bufs.values():
        buf.fill(0)
    iters = iterations(nbytes, args.iters, args.budget)
    warmup = min(args.warmup, iterations(nbytes, args.warmup, args.budget // 4))
    names = list(impls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            samples[name].append(timed_block(impls[name], bufs[name], warmup, iters))
    n = COMM.Get_size()
    return [
        Result(
            impl=name,
            nbytes=nbytes,
            count=count,
            iters=iters,
            time_s=COMM.allreduce(statistics.median(samples[name]), op=MPI.MAX),
            correct=correct[name],
            busbw_factor=2 * (n - 1) / n,
        )
        for name in names
    ]


def memcpy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Memory bandwidth of ``np.copyto`` in GB/s, counting read + write, on rank 0 alone.

    Other ranks wait in a barrier meanwhile. Collective; the value is returned on every rank.
    """
    bw = 0.0
    if COMM.Get_rank() == 0:
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault the pages in
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        bw = 2 * nbytes / statistics.median(times) / 1e9
    COMM.Barrier()
    return float(COMM.bcast(bw, root=0))


# --------------------------------------------------------------------------- reporting


def header_lines(args: argparse.Namespace, notes: Sequence[str]) -> list[str]:
    """Versions and settings printed above the table."""
    import mpi4py

    lib = MPI.Get_library_version().splitlines()[0].strip()
    return [
        f"# python {platform.python_version()}, numpy {np.__version__}, mpi4py "
        f"{mpi4py.__version__}, MPI {'.'.join(map(str, MPI.Get_version()))}: {lib}",
        f"# ringreduce {getattr(rr, '__version__', '?')}: world size {rr.size()}, "
        f"local size {rr.local_size()}; MPI world size {COMM.Get_size()}",
        *(f"# {n}" for n in notes),
        f"# dtype {args.dtype}, op sum, in place; {args.reps} reps x min(--iters {args.iters}, "
        f"{human(args.budget)} / size) iters, warmup {args.warmup}; time = max over ranks of "
        "median per-iteration time",
    ]


def table_header(impls: Sequence[str]) -> list[str]:
    """Two header rows for the results table."""
    top = f"{'':>12} {'':>9} {'':>11} "
    sub = f"{'size (B)':>12} {'size':>9} {'count':>11} "
    for name in impls:
        top += f"| {name:^30} "
        sub += f"| {'time(us)':>10} {'algbw':>9} {'busbw':>9} "
    peers = [p for p in impls if p not in VARIANTS]
    ratio_names = [f"rr/{p}" for p in peers] + (["rr/best"] if len(peers) > 1 else [])
    if ratio_names:
        top += "| " + f"{'busbw ratio':^{8 * len(ratio_names) - 1}} "
        sub += "| " + " ".join(f"{r:>7}" for r in ratio_names) + " "
    return [top + "|", sub + "| check"]


def table_row(results: Sequence[Result]) -> str:
    """One table row: sizes, per-implementation time/algbw/busbw, ratios, check status.

    Ratios are ringreduce busbw over the peer's, computed as peer time / ringreduce time so
    that they are also defined at one rank (where busbw is 0).
    """
    r0 = results[0]
    row = f"{r0.nbytes:>12} {human(r0.nbytes):>9} {r0.count:>11} "
    for r in results:
        row += f"| {r.time_s * 1e6:>10.1f} {r.algbw:>9.3f} {r.busbw:>9.3f} "
    mine = next(r for r in results if r.impl == RR)
    peers = [r for r in results if r.impl not in VARIANTS]
    ratios = [p.time_s / mine.time_s for p in peers]
    if len(peers) > 1:
        ratios.append(min(p.time_s for p in peers) / mine.time_s)
    if ratios:
        row += "| " + " ".join(f"{x:>7.2f}" for x in ratios) + " "
    wrong = [r.impl for r in results if not r.correct]
    return row + "| " + ("ok" if not wrong else "WRONG: " + ",".join(wrong))


def out_of_place_lines(rows: Sequence[Result]) -> list[str]:
    """Per size from 1 MiB up: rr-oop's time over the in-place call's, against the target."""
    by = {(r.impl, r.nbytes): r for r in rows}
    lines = []
    for r in rows:
        if r.impl == RR_OOP and r.nbytes >= OOP_FROM:
            x = r.time_s / by[(RR, r.nbytes)].time_s
            lines.append(f"# target: {RR_OOP} <= {TARGET_OOP:g}x in-place at {human(r.nbytes)}: "
                         f"{x:.2f}x  {'PASS' if x <= TARGET_OOP else 'MISS'}")
    return lines


def write_csv(path: str, rows: Sequence[Result], dtype: str, world: int) -> None:
    """Write one CSV row per (size, implementation)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["impl", "world_size", "dtype", "bytes", "count", "iters", "time_us"]
            + ["algbw_GBps", "busbw_GBps", "correct"]
        )
        for r in rows:
            w.writerow(
                [r.impl, world, dtype, r.nbytes, r.count, r.iters, f"{r.time_s * 1e6:.3f}"]
                + [f"{r.algbw:.6f}", f"{r.busbw:.6f}", int(r.correct)]
            )


def write_plot(path: str, rows: Sequence[Result], memcpy_gbps: float, title: str) -> None:
    """Save a log-log PNG of busbw against message size, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in dict.fromkeys(r.impl for r in rows):
        pts = [r for r in rows if r.impl == impl]
        ax.plot([r.nbytes for r in pts], [r.busbw for r in pts], marker="o", label=impl)
    ax.axhline(memcpy_gbps, color="gray", linestyle="--", label="memcpy (read+write)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [r.nbytes for r in rows if r.impl == RR]
    ax.set_xticks(ticks, [human(t).replace(" ", "") for t in ticks], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the sweep; print, and optionally plot and write CSV, on rank 0.

    Returns
    -------
    int
        Process exit status: 0, or 1 when any implementation returned a wrong sum.
    """
    args = parse_args(argv)
    root, say = init_ringreduce(COMM)
    start = time.perf_counter()

    impls, notes = implementations(args.peers, args.shared, args.out_of_place)
    for line in header_lines(args, notes):
        say(line, flush=True)
    mem_bw = memcpy_bandwidth()
    say(f"# memcpy bandwidth (np.copyto 256 MiB, read+write, one rank): {mem_bw:.2f} GB/s")
    say("# algbw, busbw in GB/s")
    for line in table_header(list(impls)):
        say(line, flush=True)

    dtype = np.dtype(args.dtype)
    rows: list[Result] = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor, dtype.itemsize):
        results = measure_size(impls, nbytes, dtype, args)
        rows.extend(results)
        say(table_row(results), flush=True)

    for line in out_of_place_lines(rows):
        say(line)
    bad = sorted({f"{r.impl}@{human(r.nbytes)}" for r in rows if not r.correct})
    say(f"# wrong results: {', '.join(bad) if bad else 'none'}")
    say(f"# total time {time.perf_counter() - start:.1f} s")
    if root and args.csv:
        write_csv(args.csv, rows, args.dtype, COMM.Get_size())
        say(f"# wrote {args.csv}")
    if root and args.plot:
        title = f"allreduce busbw, {COMM.Get_size()} ranks, {args.dtype}"
        write_plot(args.plot, rows, mem_bw, title)
        say(f"# wrote {args.plot}")
    COMM.Barrier()
    if "gloo" in impls:
        import torch.distributed as dist

        dist.destroy_process_group()
    rr.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
