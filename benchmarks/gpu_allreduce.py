"""GPU allreduce (or allgather) benchmark: ringreduce (its NCCL executor) against
torch.distributed's NCCL backend and CuPy's NCCL communicator, in one run and one table,
nccl-tests style.

One process per GPU, launched by ringreduce's launcher or mpirun::

    ringrun -np 2 python benchmarks/gpu_allreduce.py
    mpirun -np 2 python benchmarks/gpu_allreduce.py --max-bytes 256M
    ringrun -np 2 python benchmarks/gpu_allreduce.py --op allgather

``--op allgather``: every rank's buffer of ``size`` bytes gathered into a new array of
n x size bytes (ringreduce's column includes its host exchange of the row counts and the
output's allocation, as a user's call; the peers allocate their output too);
algbw = n x size / time, busbw = algbw (n - 1) / n, as nccl-tests reports allgather.

Every implementation sums the same float32 CuPy buffer in place (torch sees it through
DLPack, without a copy). ringreduce's column includes everything a user's call costs: the
Python intake, the engine's negotiation round, the executor's stream waits and the handle's
completion. A timed block is: a device-wide sync (torch runs NCCL on its own stream), a
host barrier, ``--warmup`` calls, a device sync, then ``--iters`` calls back to back and a
device sync; each rank takes the median
per-call time over ``--reps`` blocks, and the table reports the slowest rank's.
algbw = bytes / time; busbw = algbw * 2 (n - 1) / n. Each size is checked once per
implementation (every rank's buffer holds rank + 1: the sum is n (n + 1) / 2).

Without a CUDA device (or NCCL) it exits at once with status 2 and says what is missing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

from gpu_common import init_torch_nccl, require_gpu, this_rank_gpu

import ringreduce as rr

Fn = Callable[[Any], Any]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--op", choices=["allreduce", "allgather"], default="allreduce")
    return p.parse_args()


def peers(cp: Any, op: str) -> dict:
    """The implementations of ``op``: ringreduce always; torch NCCL and CuPy NCCL when
    importable. Each returns its result (allgather: a new array of every rank's buffer)."""
    if op == "allgather":
        impls: dict = {"ringreduce": lambda buf: rr.allgather(buf, name="bench")}
    else:
        impls = {"ringreduce": lambda buf: rr.allreduce_(buf, op=rr.Sum, name="bench")}
    try:
        import torch
        import torch.distributed as dist

        init_torch_nccl(cp.cuda.Device().id)
        if op == "allgather":
            def torch_allgather(buf: Any) -> Any:
                t = torch.from_dlpack(buf)
                out = torch.empty(t.numel() * rr.size(), dtype=t.dtype, device=t.device)
                dist.all_gather_into_tensor(out, t)
                return out
            impls["torch-nccl"] = torch_allgather
        else:
            impls["torch-nccl"] = lambda buf: dist.all_reduce(torch.from_dlpack(buf)) or buf
    except Exception as e:  # noqa: BLE001 - a peer that cannot start is left out, said why
        print(f"# torch.distributed NCCL left out on rank {rr.rank()}: {e}")
    try:
        from cupy.cuda import nccl

        uid = rr.broadcast_object(nccl.get_unique_id() if rr.rank() == 0 else None, 0,
                                  "bench.uid")
        comm = nccl.NcclCommunicator(rr.size(), uid, rr.rank())
    except Exception as e:  # noqa: BLE001 - as for torch above
        print(f"# CuPy NCCL left out on rank {rr.rank()}: {e}")
        return impls

    def cupy_allgather(buf: Any) -> Any:
        out = cp.empty(buf.size * rr.size(), cp.float32)
        comm.allGather(buf.data.ptr, out.data.ptr, buf.size, nccl.NCCL_FLOAT32,
                       cp.cuda.get_current_stream().ptr)
        return out

    def cupy_allreduce(buf: Any) -> Any:
        comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cp.cuda.get_current_stream().ptr)
        return buf

    impls["cupy-nccl"] = cupy_allgather if op == "allgather" else cupy_allreduce
    return impls


def timed(cp: Any, fn: Fn, buf: Any, args: argparse.Namespace) -> float:
    """The median per-call time (s) over ``args.reps`` blocks on this rank."""
    times = []
    for _ in range(args.reps):
        cp.cuda.Device().synchronize()
        rr.barrier()
        for _ in range(args.warmup):
            fn(buf)
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn(buf)
        cp.cuda.Device().synchronize()
        times.append((time.perf_counter() - t) / args.iters)
    return statistics.median(times)


def correct(cp: Any, fn: Fn, n: int, op: str) -> bool:
    buf = cp.full(n, rr.rank() + 1, cp.float32)
    out = cp.asarray(fn(buf))
    cp.cuda.Device().synchronize()
    if op == "allgather":
        want = cp.repeat(cp.arange(1, rr.size() + 1, dtype=cp.float32), n)
        return bool(out.shape == want.shape and (out == want).all())
    return bool((out == rr.size() * (rr.size() + 1) / 2).all())


def main() -> None:
    args = parse_args()
    require_gpu("gpu_allreduce")
    import cupy as cp

    rr.init()
    device, gpus = this_rank_gpu()
    cp.cuda.Device(device).use()
    impls = peers(cp, args.op)
    names = list(impls)
    say = print if rr.rank() == 0 else (lambda *a, **k: None)
    n = rr.size()
    what = "allgather, new output" if args.op == "allgather" else "allreduce, Sum, in place"
    shared = " (ranks share a GPU: NCCL over loopback sockets)" if n > gpus else ""
    say(f"# gpu_allreduce: {n} ranks on {gpus} GPU(s){shared}, float32, {what}; "
        f"{rr.gpu_info()['nccl_path']}")
    say(f"{'size (B)':>12} {'count':>11} " + "".join(
        f"| {name + ' time(us)':>22} {'algbw':>8} {'busbw':>8} " for name in names) + "| check")
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = nbytes // 4
        buf = cp.ones(count, cp.float32)
        row = f"{nbytes:>12} {count:>11} "
        ok = []
        for name in names:
            mine = timed(cp, impls[name], buf, args)
            slowest = max(rr.allgather_object(mine, name=f"t.{name}.{nbytes}"))
            gather = args.op == "allgather"
            algbw = nbytes * (n if gather else 1) / slowest / 1e9
            busbw = algbw * (1 if gather else 2) * (n - 1) / n
            row += f"| {slowest * 1e6:>22.1f} {algbw:>8.2f} {busbw:>8.2f} "
            ok.append(all(rr.allgather_object(correct(cp, impls[name], count, args.op),
                                              name=f"c.{name}")))
        say(row + "| " + ("ok" if all(ok) else "WRONG"))
        nbytes *= args.factor
    rr.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    main()
