"""Allreduce across real hosts made of network namespaces: sizes x hosts x link rates.

Run as root (network namespaces, veth pairs, a bridge and ``tc ... tbf``; benchmarks/_netns.py)::

    python benchmarks/hosts.py                                # the README's table
    python benchmarks/hosts.py --rates 1gbit --hosts 2 --sizes 1M,64M --plot hosts.png

Each configuration builds its hosts, starts the ranks inside them with the env-var launch
(``RINGREDUCE_HOST_ID`` per namespace), times the allreduces and tears everything down in a
``finally``. Timing follows nccl-tests: barrier, one warmup call, barrier, ``--iters`` calls;
the time is the maximum over ranks of the mean per call. busbw = algbw * 2(N-1)/N with N the
number of ranks; with one rank per host it is what each host's link carries, so it is compared
with the shaped rate (``link%``: busbw over the rate, both in bits per second; TCP/IP headers
take about 4% of a 1500-byte frame). Unshaped, the ceiling is a plain TCP stream between two
of the namespaces, measured in the same run (``--ceiling``). The hierarchical comparison runs
2 hosts x 2 ranks with ``RINGREDUCE_HIERARCHICAL_ALLREDUCE`` 0 and 1, ranks placed host by host
(as ``mpirun`` fills slots) and interleaved. MPICH's ``MPI_Allreduce`` (mpi4py) runs on the
same hosts at one rank per host (``--no-mpich`` to skip), launched from host 0 by Hydra with
benchmarks/_netns_ssh.py standing in for ssh.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
# The namespace "hosts" share this machine's cores: ranks that spin while waiting take the
# CPU from the ranks they wait for (real hosts have cores of their own). --spin-us sets it.
SPIN_US = "0"
sys.path.insert(0, HERE)

import _netns  # noqa: E402  (next to this file)


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def fmt_size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# ------------------------------------------------------------------ inside a namespace
class Api:
    """The calls a timed loop needs, for ringreduce and for MPI (mpi4py)."""

    def __init__(self, mpi: bool) -> None:
        import numpy as np

        self.np = np
        if mpi:
            from mpi4py import MPI

            c = MPI.COMM_WORLD
            self.rank, self.size = c.Get_rank(), c.Get_size()
            self.barrier = c.Barrier
            self.sum_ = lambda x: c.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            self.gather = lambda x: c.allgather(x)
            self.max = lambda v: c.allreduce(v, op=MPI.MAX)
            self.hierarchical = lambda: False
            self.hierarchical_gather = lambda: False
            self.finish = lambda: None
            return
        import ringreduce as rr

        rr.init()
        self.rank, self.size = rr.rank(), rr.size()
        self.barrier = rr.barrier
        self.sum_ = lambda x: rr.allreduce_(x, op=rr.Sum, name="x")
        self.gather = lambda x: rr.allgather(x, name="g")
        self.max = lambda v: float(rr.allreduce(np.array([v]), op=rr.Max, name="t")[0])
        self.hierarchical = lambda: min(rr.allgather_object(_hier_count(), name="h")) > 0
        self.hierarchical_gather = lambda: min(
            rr.allgather_object(_hier_count("hierarchical_allgathers"), name="hg")) > 0
        self.finish = rr.shutdown


def worker(sizes: Sequence[int], iters: int, seconds: float, mpi: bool, op: str) -> None:
    """One rank: allreduce float32 buffers of ``sizes`` bytes in place (or, ``op`` allgather,
    gather 1/N of them from every rank: ``size`` is the output, nccl-tests' convention), at
    least ``iters`` times and about ``seconds`` long; rank 0 prints one JSON line per size."""
    api = Api(mpi)
    np, n = api.np, api.size
    gather = op == "allgather"
    for size in sizes:
        x = np.full(size // 4 // (n if gather else 1), api.rank + 1, np.float32)
        call = (lambda x=x: api.gather(x)) if gather else (lambda x=x: api.sum_(x))
        api.barrier()
        t0 = time.perf_counter()
        call()  # warmup; its time sets the count, agreed by all ranks
        count = int(api.max(max(iters, min(200, int(seconds / (time.perf_counter() - t0))))))
        api.barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            out = call()
        worst = api.max((time.perf_counter() - t0) / count)
        if gather:
            out = np.concatenate(out) if isinstance(out, list) else out
            good = np.array_equal(out, np.repeat(np.arange(1, n + 1, dtype=np.float32), x.size))
        else:  # the timed calls summed x again and again: sum a fresh one
            x.fill(api.rank + 1)
            call()
            good = bool((x == n * (n + 1) / 2).all())
        ok = bool(api.max(float(not good)) == 0)
        hier = api.hierarchical_gather() if gather else api.hierarchical()
        if api.rank == 0:
            print(json.dumps({"bytes": x.nbytes * (n if gather else 1), "seconds": worst,
                              "ok": ok, "iters": count, "hierarchical": hier}), flush=True)
    api.finish()


def _hier_count(what: str = "hierarchical_allreduces") -> int:
    from ringreduce import _Process

    return _Process.comm._engine.stats()[what]


def stream_receiver(port: int) -> None:
    """Accept one connection and print how fast it delivered (bytes / second)."""
    srv = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf, got, t0 = bytearray(1 << 20), 0, None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        got += k
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}), flush=True)


def stream_sender(addr: str, port: int, total: int) -> None:
    conn = socket.create_connection((addr, port))
    chunk = bytes(1 << 20)
    for _ in range(total >> 20):
        conn.sendall(chunk)
    conn.close()


# ------------------------------------------------------------------ orchestration
def run_job(hosts: _netns.Hosts, placement: Sequence[int], sizes: Sequence[int], iters: int,
            seconds: float, extra_env: dict, timeout: float, op: str = "allreduce"
            ) -> list[dict]:
    """Run the worker with rank r on host placement[r]; rank 0's result lines."""
    env = {**os.environ, "MASTER_PORT": "29611", "RINGREDUCE_SECRET": os.urandom(16).hex(),
           "PYTHONUNBUFFERED": "1", "RINGREDUCE_SPIN_US": SPIN_US, **extra_env}
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE", "PMIX_RANK"):
        env.pop(k, None)
    procs = _netns.spawn(hosts, placement, worker_argv(sizes, iters, seconds, op=op), env)
    return collect(procs, timeout)


def worker_argv(sizes: Sequence[int], iters: int, seconds: float, mpi: bool = False,
                op: str = "allreduce") -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", *(["--mpi"] if mpi else []),
            "--sizes", ",".join(map(str, sizes)), "--iters", str(iters),
            "--seconds", str(seconds), "--op", op]


def run_mpich(hosts: _netns.Hosts, sizes: Sequence[int], iters: int, seconds: float,
              timeout: float) -> list[dict]:
    """MPI_Allreduce, one rank per host, launched by MPICH's Hydra from host 0 through
    _netns_ssh.py; local shared memory off and TCP on eth0 forced, since all the namespaces
    share one hostname (Hydra and UCX would otherwise see one node and bypass the link)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    genv = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
            "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}
    cmd = [*hosts.exec_prefix(0), mpiexec, "-launcher", "ssh", "-launcher-exec",
           os.path.join(HERE, "_netns_ssh.py"), "-iface", "eth0", "-hosts",
           ",".join(hosts.names), "-n", str(len(hosts.names)), "-ppn", "1"]
    for k, v in genv.items():
        cmd += ["-genv", k, v]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    proc = subprocess.Popen([*cmd, *worker_argv(sizes, iters, seconds, mpi=True)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return collect([proc], timeout)


def collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Wait for every process (killing them all at ``timeout``); the JSON lines printed."""
    outs = [""] * len(procs)
    try:
        deadline = time.monotonic() + timeout
        for i, p in enumerate(procs):
            outs[i], _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"ranks failed {bad}:\n" + "\n".join(outs))
    return [json.loads(line) for out in outs for line in out.splitlines()
            if line.startswith("{")]


def tcp_ceiling(hosts: _netns.Hosts, total: int) -> float:
    """Bytes per second of one plain TCP stream from host 1 to host 0."""
    recv = subprocess.Popen([*hosts.exec_prefix(0), sys.executable, __file__, "--receiver",
                             "29612"], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
        subprocess.run([*hosts.exec_prefix(1), sys.executable, __file__, "--sender",
                        hosts.addrs[0], "29612", str(total)], check=True, timeout=300)
        out, _ = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    res = json.loads(out.strip().splitlines()[-1])
    return res["bytes"] / res["seconds"]


HEADER = (f"{'config':<28}{'size':>8}{'time(us)':>12}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"
          f"{'link(Gbit/s)':>14}{'link%':>7}  check")


def print_row(label: str, n: int, r: dict, link_bits: Optional[float],
              factor: Optional[float] = None) -> dict:
    """``factor``: busbw / algbw (nccl-tests: allreduce 2(N-1)/N, the default;
    allgather (N-1)/N)."""
    algbw = r["bytes"] / r["seconds"] / 1e9
    busbw = algbw * (2 * (n - 1) / n if factor is None else factor)
    pct = f"{100 * busbw * 8e9 / link_bits:.0f}" if link_bits else "-"
    link = f"{link_bits / 1e9:.2f}" if link_bits else "-"
    print(f"{label:<28}{fmt_size(r['bytes']):>8}{r['seconds'] * 1e6:>12.0f}{algbw:>13.3f}"
          f"{busbw:>13.3f}{link:>14}{pct:>7}  {'OK' if r['ok'] else 'WRONG'}", flush=True)
    return {"label": label, "ranks": n, "busbw": busbw, "link": link_bits, **r}


def sweep_rates(args: argparse.Namespace, sizes: list[int]) -> list[dict]:
    rows = []
    for rate in args.rates:
        shaped = None if rate == "none" else rate
        for h in args.hosts:
            with _netns.Hosts(h, rate=shaped) as hosts:
                link = _netns.rate_bits(shaped) if shaped else None
                if link is None and args.ceiling:
                    link = tcp_ceiling(hosts, args.ceiling_bytes) * 8
                    print(f"# plain TCP stream between two namespaces: {link / 1e9:.2f} Gbit/s "
                          "(the unshaped ceiling)", flush=True)
                for r in run_job(hosts, list(range(h)), sizes, args.iters, args.seconds, {},
                                 args.timeout):
                    rows.append(print_row(f"{rate} {h}x1", h, r, link))
                if args.mpich:
                    for r in run_mpich(hosts, sizes, args.iters, args.seconds, args.timeout):
                        rows.append(print_row(f"{rate} {h}x1 mpich", h, r, link))
    return rows


def compare_hierarchical(args: argparse.Namespace, sizes: list[int]) -> list[dict]:
    rows = []
    rate = args.hier_rate
    with _netns.Hosts(2, rate=rate) as hosts:
        link = _netns.rate_bits(rate)
        for place_name, placement in (("by-host", [0, 0, 1, 1]), ("interleaved", [0, 1, 0, 1])):
            times = {}
            for setting in ("0", "1"):
                env = {"RINGREDUCE_HIERARCHICAL_ALLREDUCE": setting}
                for r in run_job(hosts, placement, sizes, args.iters, args.seconds, env,
                                 args.timeout):
                    algo = "hier" if r["hierarchical"] else "flat"
                    rows.append(print_row(f"{rate} 2x2 {place_name} {algo}", 4, r, link))
                    times[(setting, r["bytes"])] = r["seconds"]
            for size in sizes:
                print(f"# {place_name} {fmt_size(size)}: hierarchical is "
                      f"{times[('0', size)] / times[('1', size)]:.2f}x the flat ring", flush=True)
    return rows


def compare_hierarchical_allgather(args: argparse.Namespace, sizes: list[int]) -> list[dict]:
    """RINGREDUCE_HIERARCHICAL_ALLGATHER 0 and 1 at 2 hosts x 2 ranks, placed host by host."""
    rows, times = [], {}
    rate = args.hier_rate
    with _netns.Hosts(2, rate=rate) as hosts:
        link = _netns.rate_bits(rate)
        for setting in ("0", "1"):
            env = {"RINGREDUCE_HIERARCHICAL_ALLGATHER": setting}
            for r in run_job(hosts, [0, 0, 1, 1], sizes, args.iters, args.seconds, env,
                             args.timeout, op="allgather"):
                algo = "hier" if r["hierarchical"] else "flat"
                rows.append(print_row(f"{rate} 2x2 allgather {algo}", 4, r, link, 3 / 4))
                times[(setting, r["bytes"])] = r["seconds"]
    for size in sizes:
        print(f"# allgather {fmt_size(size)}: hierarchical is "
              f"{times[('0', size)] / times[('1', size)]:.2f}x the flat ring", flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("# --plot needs matplotlib, which is not installed; no plot written")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = [r for r in rows if r["label"] == label]
        ax.plot([p["bytes"] for p in pts], [p["busbw"] * 8 for p in pts], marker="o",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("busbw (Gbit/s)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    global SPIN_US
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--hosts", default="2,3,4")
    p.add_argument("--rates", default="1gbit,10gbit,none", help="tc rates; none = unshaped")
    p.add_argument("--iters", type=int, default=3, help="at least this many timed calls")
    p.add_argument("--seconds", type=float, default=1.0, help="and about this long per size")
    p.add_argument("--no-mpich", dest="mpich", action="store_false")
    p.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hier-rate", default="1gbit")
    p.add_argument("--no-hier", action="store_true", help="skip the hierarchical comparisons")
    p.add_argument("--op", choices=("allreduce", "allgather"), default="allreduce",
                   help=argparse.SUPPRESS)
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false")
    p.add_argument("--ceiling-bytes", type=parse_size, default=parse_size("512M"))
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--spin-us", default=SPIN_US, help="RINGREDUCE_SPIN_US of the ranks")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sender", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    SPIN_US = args.spin_us
    if args.worker:
        return worker(sizes, args.iters, args.seconds, args.mpi, args.op)
    if args.receiver is not None:
        return stream_receiver(args.receiver)
    if args.sender:
        return stream_sender(args.sender[0], int(args.sender[1]), int(args.sender[2]))
    why = _netns.available()
    if why:
        print(f"# skipped: {why}")
        return None
    gone = _netns.cleanup_leftovers()
    if gone:
        print(f"# removed leftovers of killed runs: {' '.join(gone)}")
    args.rates = args.rates.split(",")
    args.hosts = [int(h) for h in args.hosts.split(",")]
    print(f"# allreduce across network-namespace hosts; float32 Sum in place; 1 warmup, then "
          f">= {args.iters} calls and about {args.seconds} s per size; "
          f"{os.cpu_count()} CPUs shared by all ranks; RINGREDUCE_SPIN_US={SPIN_US}")
    print(HEADER)
    rows = sweep_rates(args, sizes)
    if not args.no_hier:
        rows += compare_hierarchical(args, sizes)
        rows += compare_hierarchical_allgather(args, sizes)
    if args.plot:
        plot(rows, args.plot)
    return None


if __name__ == "__main__":
    main()
