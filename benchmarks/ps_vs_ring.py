"""Parameter server against ring allreduce, on the same TCP transport, at N ranks.

Run under MPI (mpi4py bootstraps the peers and gathers the timings); to sweep the rank
count, run it once per N::

    mpirun -np 3 python benchmarks/ps_vs_ring.py
    for n in 2 3 4; do mpirun -np $n python benchmarks/ps_vs_ring.py; done    # --sweep-ranks
    for n in 2 3 4; do mpirun -np $n python benchmarks/ps_vs_ring.py --link-gbps 0.2 \
        --max-bytes 16M --reps 3; done                        # each rank behind a 0.2 GB/s NIC
    mpirun -np 4 python benchmarks/ps_vs_ring.py --min-bytes 1M --max-bytes 256M --reps 3

Every implementation averages one float32 gradient buffer over all N ranks, in place:

``ps-tcp``
    The parameter-server pattern, colocated: rank 0 is the server and also a worker. Every
    other rank sends its whole buffer to rank 0; rank 0 receives from all workers at once
    (one thread, non-blocking sockets and ``select``, as an event-driven server would), adds
    the N buffers in rank order, divides by N and sends the full average back to all
    workers at once.
``ring-tcp``
    A bandwidth-optimal ring allreduce in Python over the same kind of sockets (each rank
    connected to its right neighbour and accepted from its left one): reduce-scatter, then
    allgather, N - 1 steps each on chunks of size / N, numpy adds, and the owner of each
    reduced chunk divides it by N. In each step the send to the right and the receive from
    the left progress together in one ``select`` loop (sent one after the other, a chunk
    larger than the socket buffers would deadlock the ring).
``ringreduce``
    ``rr.allreduce_(buf, op=rr.Average)``, the library's C++ ring, with
    ``RINGREDUCE_TRANSPORT=tcp`` (set by ``--rr-transport``, default ``tcp``) so that it
    also runs over TCP; ``--rr-transport auto`` gives its shared-memory ring instead.

The two Python implementations share their transport code (plain ``socket`` streams,
``TCP_NODELAY``, ``send`` / ``recv_into`` straight from and into numpy memory, one
connection per pair set up once at start, addresses exchanged with mpi4py; loopback when
all ranks share a host), so their difference is the algorithm alone. No socket waits
forever: every wait for progress is bounded by ``--timeout`` (60 s).

Why they differ: per iteration the server receives (N - 1) x size and sends as much, while
every ring rank receives and sends 2 (N - 1) / N x size, less than 2 x size at any N: the
server's link carries N / 2 times a ring rank's traffic. The server also cannot send before
it has received everything, so its in and out do not overlap, while every ring step sends
and receives at once. Where each rank has a link of its own and the links are the cost (a
cluster), the parameter server takes 2 (N - 1) x size / B against the ring's
2 (N - 1) / N x size / B, N times longer (the "links-only model" of the summary lines);
the ring's time hardly grows with N, the server's grows linearly. The table gives both byte
counts per size.

On one host without ``--link-gbps`` there are no separate links: loopback TCP costs the CPU
of both ends (copies into and out of the kernel), so once the ranks outnumber the cores the
ring's N ranks, which move as many bytes in all as the server does, share the same cores,
and the two come out close. ``--link-gbps X`` emulates a NIC per rank instead: a token
bucket caps what each rank sends at X GB/s, and another what it receives (bursts of 1 ms of
the link); pick X well below what the machine's cores can copy, and the measured ratio
follows the model. The ringreduce column is left out then (its transport is not paced).

Timing follows ``benchmarks/allreduce.py`` (nccl-tests): each result is checked exactly
first (rank r contributes ``(r + 1) * (i % 7 + 1)``, whose average is exact in float32);
then, on zeros, a timed block is barrier, warmup, barrier, ``iters`` back-to-back calls;
each rank takes the median per-iteration time over ``--reps`` blocks, and the reported time
is the maximum of that over ranks. The implementations are interleaved per size, their
order rotated between blocks. algbw = size / time; busbw = algbw x 2 (N - 1) / N for all
three, so the columns compare directly (the parameter server's own traffic is not what
busbw counts; the traffic columns give it).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from allreduce import human, iterations, parse_bytes, sizes, timed_block
from bench_common import init_ringreduce
from mpi4py import MPI

import ringreduce as rr

COMM = MPI.COMM_WORLD
PS, RING, RR = "ps-tcp", "ring-tcp", "ringreduce"
DTYPE = np.dtype(np.float32)
_HELLO = struct.Struct("!ii")  # (kind, rank), the first bytes on every connection
_KIND_RING, _KIND_PS = 1, 2

#: An allreduce under test: averages the given float32 buffer over all ranks, in place.
AllreduceFn = Callable[[np.ndarray], None]
#: One transfer: a socket and the bytes to send from, or receive into, in full.
Transfer = tuple[socket.socket, memoryview]


@dataclass
class Result:
    """Timing and check of one implementation at one size."""

    impl: str
    nbytes: int
    time_s: float  # per iteration: max over ranks of the median over repetitions
    correct: bool
    world: int

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.time_s / 1e9

    @property
    def busbw(self) -> float:
        """Bus bandwidth in GB/s: ``algbw * 2 (n - 1) / n``."""
        return self.algbw * 2 * (self.world - 1) / self.world


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns
    -------
    argparse.Namespace
        The parsed flags.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=64 << 10, help="smallest size (64K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20, help="largest size (64M)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows (4)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations at small sizes (20)")
    p.add_argument("--warmup", type=int, default=2, help="warmup iterations at small sizes (2)")
    p.add_argument("--reps", type=int, default=5, help="timed blocks per size; median taken (5)")
    p.add_argument("--budget", type=parse_bytes, default=256 << 20,
                   help="bytes per timed block: iters = min(--iters, budget / size), >= 1 (256M)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds any socket may go without progress before failing (60)")
    p.add_argument("--rr-transport", choices=("tcp", "auto", "shm"), default="tcp",
                   help="RINGREDUCE_TRANSPORT for the ringreduce column (tcp)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="emulate a NIC per rank: cap what each rank sends, and what it "
                        "receives, at this many GB/s each way; drops the ringreduce column "
                        "(0: off)")
    args = p.parse_args(argv)
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    if min(args.iters, args.reps) < 1 or args.warmup < 0 or args.timeout <= 0:
        p.error("need --iters >= 1, --reps >= 1, --warmup >= 0, --timeout > 0")
    if args.link_gbps < 0:
        p.error("need --link-gbps >= 0")
    return args


# --------------------------------------------------------------------------- transport


def as_bytes(a: np.ndarray) -> memoryview:
    """A writable byte view of a contiguous array (no copy)."""
    return memoryview(a).cast("B")


class Bucket:
    """A token bucket: at most ``rate`` bytes per second, bursts of at most ``burst`` bytes."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.monotonic()

    def take(self, want: int) -> int:
        """Grant up to ``want`` bytes now, or 0 until ``min(want, burst / 2)`` can be (a
        grant of the few bytes that trickle in meanwhile would make the caller spin)."""
        now = time.monotonic()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < min(want, self.burst / 2):
            return 0
        got = int(min(want, self.tokens))
        self.tokens -= got
        return got

    def refund(self, nbytes: int) -> None:
        """Give back granted bytes the socket did not take."""
        self.tokens += nbytes

    def delay(self) -> float:
        """Seconds until half a burst can be granted (waking for less costs more CPU)."""
        return max(1e-5, (self.burst / 2 - self.tokens) / self.rate)


@dataclass
class Wire:
    """How transfers run: the no-progress timeout and, with ``--link-gbps``, one bucket for
    everything this rank sends and one for everything it receives (an emulated NIC)."""

    timeout: float
    egress: Optional[Bucket] = None
    ingress: Optional[Bucket] = None


def make_wire(args: argparse.Namespace) -> Wire:
    """The timeout, and with ``--link-gbps`` the buckets: bursts of 1 ms of the link (at
    least 64 KiB), slack for a wake-up that comes late on a busy machine."""
    rate = args.link_gbps * 1e9
    if not rate:
        return Wire(args.timeout)
    burst = max(64 << 10, int(rate * 1e-3))
    return Wire(args.timeout, Bucket(rate, burst), Bucket(rate, burst))


def _step(t: list, bucket: Optional[Bucket], send: bool) -> Optional[int]:
    """Move what a non-blocking socket takes of transfer ``t`` = [socket, view, done].

    Returns the bytes moved, or None when the bucket had nothing to grant.
    """
    sock, view, done = t
    want = view.nbytes - done
    grant = bucket.take(want) if bucket else want
    if grant == 0:
        return None
    try:
        moved = sock.send(view[done:done + grant]) if send else sock.recv_into(view[done:], grant)
        if moved == 0 and not send:
            raise ConnectionError(f"peer {sock.getpeername()} closed the connection")
    except BlockingIOError:
        moved = 0
    if bucket:
        bucket.refund(grant - moved)
    t[2] += moved
    return moved


def exchange(wire: Wire, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
    """Send and receive several whole buffers at once on non-blocking sockets.

    Every transfer progresses as far as its socket (and bucket) allows on each pass; when
    none made progress, ``select`` waits for a socket that can (or, for a direction whose
    bucket is empty, a sleep for its tokens). A socket may appear once among the sends and
    once among the receives.

    Parameters
    ----------
    wire : Wire
        Timeout and optional pacing.
    sends, recvs : sequence of (socket, memoryview)
        Buffers to send in full, and to fill in full.

    Raises
    ------
    TimeoutError
        When no transfer progressed for ``wire.timeout`` seconds.
    """
    out = [[s, mv, 0] for s, mv in sends if mv.nbytes]
    inc = [[s, mv, 0] for s, mv in recvs if mv.nbytes]
    deadline = None
    while out or inc:
        sent = [_step(t, wire.egress, True) for t in out]
        got = [_step(t, wire.ingress, False) for t in inc]
        if any(sent) or any(got):
            out = [t for t in out if t[2] < t[1].nbytes]
            inc = [t for t in inc if t[2] < t[1].nbytes]
            deadline = None
            continue
        now = time.monotonic()
        deadline = deadline or now + wire.timeout
        if now >= deadline:
            raise TimeoutError(f"no progress on any socket for {wire.timeout:.0f} s")
        wait = deadline - now
        for bucket, moved in ((wire.egress, sent), (wire.ingress, got)):
            if bucket and None in moved:
                wait = min(wait, bucket.delay())
        readers = [t[0] for t, m in zip(inc, got) if m is not None]
        writers = [t[0] for t, m in zip(out, sent) if m is not None]
        if readers or writers:
            select.select(readers, writers, [], wait)
        else:
            time.sleep(wait)


def local_address() -> str:
    """Address the other ranks can reach this one at: loopback when all share one host."""
    node = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = node.Get_size() == COMM.Get_size()
    node.Free()
    return "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname())


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection during setup")
        data += chunk
    return data


@dataclass
class Links:
    """This rank's connections: ring neighbours and, on the parameter server's side, the
    other end of every worker's connection (``None`` where a role has none)."""

    right: Optional[socket.socket]  # ring: this rank sends to rank + 1
    left: Optional[socket.socket]  # ring: this rank receives from rank - 1
    server: Optional[socket.socket]  # on workers: the connection to rank 0
    workers: list[socket.socket]  # on rank 0: connections from ranks 1 .. n-1, in rank order
    wire: Wire  # timeout and pacing of every transfer
    address: str = "-"  # where this rank listened

    def close(self) -> None:
        """Close every socket."""
        for s in (self.right, self.left, self.server, *self.workers):
            if s is not None:
                s.close()


def _tune(sock: socket.socket, timeout: float) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    return sock


def connect(wire: Wire) -> Links:
    """Open every connection both Python implementations use, once (collective).

    Each rank listens on an ephemeral port; the addresses go around with mpi4py. Each rank
    connects to its right neighbour and (workers) to rank 0, then accepts the connections
    it expects, told apart by a (kind, rank) greeting. The sockets end up non-blocking
    (``exchange`` bounds every wait).
    """
    n, rank, timeout = COMM.Get_size(), COMM.Get_rank(), wire.timeout
    if n == 1:
        return Links(None, None, None, [], wire)
    address = local_address()
    listener = _tune(socket.socket(socket.AF_INET, socket.SOCK_STREAM), timeout)
    listener.bind((address, 0))
    listener.listen(n)
    addrs = COMM.allgather(listener.getsockname())

    def dial(peer: int, kind: int) -> socket.socket:
        s = _tune(socket.create_connection(addrs[peer], timeout=timeout), timeout)
        s.sendall(_HELLO.pack(kind, rank))
        return s

    right = dial((rank + 1) % n, _KIND_RING)
    server = dial(0, _KIND_PS) if rank != 0 else None
    left, workers = None, {}
    for _ in range(1 + (n - 1 if rank == 0 else 0)):
        s, _addr = listener.accept()
        kind, peer = _HELLO.unpack(_recv_exact(_tune(s, timeout), _HELLO.size))
        if kind == _KIND_RING and peer == (rank - 1) % n:
            left = s
        elif kind == _KIND_PS and rank == 0:
            workers[peer] = s
        else:
            raise ConnectionError(f"rank {rank}: unexpected greeting {kind, peer}")
    listener.close()
    links = Links(right, left, server, [workers[r] for r in range(1, n) if rank == 0], wire,
                  address)
    for s in (links.right, links.left, links.server, *links.workers):
        if s is not None:
            s.setblocking(False)
    COMM.Barrier()
    return links


# --------------------------------------------------------------------------- implementations


class Scratch:
    """A float32 buffer reused across calls of the same size (allocated outside timing)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, DTYPE)

    def get(self, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous array of ``shape`` (contents undefined)."""
        if self.buf.shape != shape:
            self.buf = np.empty(shape, DTYPE)
        return self.buf


def make_ps(links: Links) -> AllreduceFn:
    """The colocated parameter server: workers push to rank 0, rank 0 averages and pushes
    the result back. Rank 0 receives from all workers concurrently, then sends concurrently."""
    n, wire = COMM.Get_size(), links.wire
    inbox = Scratch()

    def server(buf: np.ndarray) -> None:
        got = inbox.get((n - 1, buf.size))
        exchange(wire, [], [(w, as_bytes(got[i])) for i, w in enumerate(links.workers)])
        for row in got:  # rank order: 0 + 1 + ... + n-1, the same sum every time
            np.add(buf, row, out=buf)
        np.divide(buf, DTYPE.type(n), out=buf)
        exchange(wire, [(w, as_bytes(buf)) for w in links.workers], [])

    def worker(buf: np.ndarray) -> None:
        assert links.server is not None
        exchange(wire, [(links.server, as_bytes(buf))], [])
        exchange(wire, [], [(links.server, as_bytes(buf))])

    if n == 1:
        return lambda buf: None
    return server if COMM.Get_rank() == 0 else worker


def make_ring(links: Links) -> AllreduceFn:
    """The bandwidth-optimal ring: reduce-scatter then allgather, N - 1 steps each."""
    n, rank, wire = COMM.Get_size(), COMM.Get_rank(), links.wire
    scratch = Scratch()

    def ring(buf: np.ndarray) -> None:
        assert links.left is not None and links.right is not None
        bounds = [buf.size * i // n for i in range(n + 1)]
        chunk = [buf[bounds[c]:bounds[c + 1]] for c in range(n)]
        tmp = scratch.get((-(-buf.size // n),))
        for step in range(n - 1):  # reduce-scatter: pass partial sums to the right
            mine, theirs = chunk[(rank - step) % n], chunk[(rank - step - 1) % n]
            part = tmp[:theirs.size]
            exchange(wire, [(links.right, as_bytes(mine))], [(links.left, as_bytes(part))])
            np.add(theirs, part, out=theirs)
        owned = chunk[(rank + 1) % n]  # now the sum over all ranks
        np.divide(owned, DTYPE.type(n), out=owned)
        for step in range(n - 1):  # allgather: pass finished chunks to the right
            mine, theirs = chunk[(rank + 1 - step) % n], chunk[(rank - step) % n]
            exchange(wire, [(links.right, as_bytes(mine))], [(links.left, as_bytes(theirs))])

    return ring if n > 1 else (lambda buf: None)


def rr_average(buf: np.ndarray) -> None:
    """ringreduce, in place."""
    rr.allreduce_(buf, op=rr.Average)


# --------------------------------------------------------------------------- measuring


def check(fn: AllreduceFn, buf: np.ndarray) -> bool:
    """Run ``fn`` once on rank-dependent integer data and verify the average exactly.

    Rank ``r`` contributes ``(r + 1) * (i % 7 + 1)`` at element ``i``; the average is
    ``(n + 1) / 2 * (i % 7 + 1)``, a multiple of 0.5 below 32: exact in float32.

    Returns
    -------
    bool
        True when the result is exact on all ranks.
    """
    n = COMM.Get_size()
    pattern = (np.arange(buf.size) % 7 + 1).astype(DTYPE)
    np.multiply(pattern, DTYPE.type(COMM.Get_rank() + 1), out=buf)
    fn(buf)
    ok = bool(np.array_equal(buf, pattern * DTYPE.type((n + 1) / 2)))
    return bool(COMM.allreduce(ok, op=MPI.LAND))


def measure_size(impls: dict[str, AllreduceFn], nbytes: int,
                 args: argparse.Namespace) -> list[Result]:
    """Check and time every implementation at one size, interleaved.

    Parameters
    ----------
    impls : dict of str to callable
        Implementations to compare, in table order.
    nbytes : int
        Buffer size in bytes (a multiple of 4).
    args : argparse.Namespace
        Iteration settings.

    Returns
    -------
    list of Result
        One per implementation, in ``impls`` order; identical on every rank.
    """
    buf = np.empty(nbytes // DTYPE.itemsize, DTYPE)
    correct = {name: check(fn, buf) for name, fn in impls.items()}
    buf.fill(0)  # the average of zeros stays zero, and costs the same to compute
    iters = iterations(nbytes, args.iters, args.budget)
    warmup = min(args.warmup, iterations(nbytes, args.warmup, args.budget // 4))
    names = list(impls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            samples[name].append(timed_block(impls[name], buf, warmup, iters))
    n = COMM.Get_size()
    return [Result(name, nbytes, COMM.allreduce(statistics.median(samples[name]), op=MPI.MAX),
                   correct[name], n) for name in names]


# --------------------------------------------------------------------------- reporting


def traffic(nbytes: int, n: int) -> tuple[float, float]:
    """Bytes received per iteration by the PS server and by one ring rank (each also sends
    as many): ``(n - 1) * nbytes`` and ``2 (n - 1) / n * nbytes``."""
    return (n - 1) * nbytes, 2 * (n - 1) / n * nbytes


def header_lines(args: argparse.Namespace, links: Links) -> list[str]:
    """Versions, settings and the traffic explanation printed above the table."""
    import mpi4py

    n = COMM.Get_size()
    lib = MPI.Get_library_version().splitlines()[0].strip()
    ps_in, ring_in = traffic(1, n)
    egress = links.wire.egress
    pacing = (f"# emulated links: each rank sends at most {args.link_gbps:g} GB/s and "
              "receives at most as much (token buckets in exchange(), bursts of "
              f"{human(egress.burst)}); ringreduce left out (its transport is not paced)"
              if egress else
              "# links not emulated: loopback TCP, so every transfer costs the CPU of "
              "both ends (copies into and out of the kernel)")
    return [
        f"# python {sys.version.split()[0]}, numpy {np.__version__}, mpi4py "
        f"{mpi4py.__version__} ({lib}); ringreduce {getattr(rr, '__version__', '?')}",
        f"# {n} ranks on {os.cpu_count()} cores; ringreduce with RINGREDUCE_TRANSPORT="
        f"{os.environ['RINGREDUCE_TRANSPORT']}; ps-tcp and ring-tcp: Python sockets over "
        f"{links.address}",
        f"# float32 average, in place; {args.reps} reps x min(--iters {args.iters}, "
        f"{human(args.budget)} / size) iters, warmup {args.warmup}; time = max over ranks "
        "of the median per-iteration time; algbw, busbw in GB/s; busbw = algbw x 2(N-1)/N",
        f"# traffic per iteration: the PS server receives (N-1) x size = {ps_in:g} x size "
        f"and sends as much; each ring rank receives 2(N-1)/N x size = {ring_in:.3g} x size "
        f"and sends as much; server / ring rank = N/2 = {n / 2:g}",
        pacing,
    ]


def table_header(impls: Sequence[str]) -> list[str]:
    """Two header rows for the results table."""
    top = f"{'':>12} {'':>9} "
    sub = f"{'size (B)':>12} {'size':>9} "
    for name in impls:
        top += f"| {name:^30} "
        sub += f"| {'time(us)':>10} {'algbw':>9} {'busbw':>9} "
    top += f"| {'time ratio':^15} | {'bytes in / iter':^21} "
    sub += f"| {'ps/ring':>7} {'ps/rr':>7} | {'ps server':>10} {'ring rank':>10} "
    return [top + "|", sub + "| check"]


def table_row(results: Sequence[Result]) -> str:
    """One row: sizes, per-implementation time/algbw/busbw, ratios, traffic, check."""
    by = {r.impl: r for r in results}
    r0 = results[0]
    row = f"{r0.nbytes:>12} {human(r0.nbytes):>9} "
    for r in results:
        row += f"| {r.time_s * 1e6:>10.1f} {r.algbw:>9.3f} {r.busbw:>9.3f} "
    ratios = [f"{by[PS].time_s / by[p].time_s:.2f}" if p in by else "-" for p in (RING, RR)]
    row += "| " + " ".join(f"{x:>7}" for x in ratios) + " "
    ps_in, ring_in = traffic(r0.nbytes, r0.world)
    row += f"| {human(ps_in):>10} {human(ring_in):>10} "
    wrong = [r.impl for r in results if not r.correct]
    return row + "| " + ("ok" if not wrong else "WRONG: " + ",".join(wrong))


def summary_lines(rows: Sequence[list[Result]]) -> list[str]:
    """One line per size: the parameter server's time over the rings'."""
    out = []
    for results in rows:
        by = {r.impl: r for r in results}
        n, nbytes = results[0].world, results[0].nbytes
        ratios = ", ".join(f"{by[PS].time_s / by[p].time_s:.2f} (ps-tcp / {p})"
                           for p in (RING, RR) if p in by)
        out.append(f"# ps/ring time ratio at N={n}, {human(nbytes)}: {ratios}; "
                   f"server / ring-rank bytes N/2 = {n / 2:g}; links-only model N = {n}")
    return out


# --------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the sweep and print the table on rank 0.

    Returns
    -------
    int
        Process exit status: 0, or 1 when any implementation returned a wrong average.
    """
    args = parse_args(argv)
    os.environ["RINGREDUCE_TRANSPORT"] = args.rr_transport  # read by rr.init()
    _root, say = init_ringreduce(COMM)
    start = time.perf_counter()
    links = connect(make_wire(args))
    impls = {PS: make_ps(links), RING: make_ring(links)}
    if not args.link_gbps:
        impls[RR] = rr_average
    for line in header_lines(args, links) + table_header(list(impls)):
        say(line, flush=True)
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor, DTYPE.itemsize):
        rows.append(measure_size(impls, nbytes, args))
        say(table_row(rows[-1]), flush=True)
    bad = sorted({f"{r.impl}@{human(r.nbytes)}" for rs in rows for r in rs if not r.correct})
    for line in summary_lines(rows):
        say(line)
    say(f"# wrong results: {', '.join(bad) if bad else 'none'}")
    say(f"# total time {time.perf_counter() - start:.1f} s")
    COMM.Barrier()
    links.close()
    rr.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
