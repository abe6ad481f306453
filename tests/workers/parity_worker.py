"""Horovod parity in real processes: grouped allgather/reducescatter, sparse allreduce,
Adasum, the new integer dtypes, the run-time timeline, Horovod's exception names.

    mpirun -np N python parity_worker.py TIMELINE_PATH

Each check raises on failure; at the end every rank logs ``OK rank <r>``.
"""

from __future__ import annotations

import sys

import torch
from workerlib import run, say, set_rank

import ringreduce.torch as hvd


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {hvd.rank()}: {what}")


def grouped() -> None:
    r, n = hvd.rank(), hvd.size()
    xs = [torch.full((r + 1, 2), float(r)), torch.arange(3 * n, dtype=torch.int16) + r]
    gathered = hvd.grouped_allgather(xs, name="ga")
    expect(gathered[0].shape == (n * (n + 1) // 2, 2), "grouped_allgather shape")
    expect(torch.equal(gathered[1][: 3 * n], torch.arange(3 * n, dtype=torch.int16)),
           "grouped_allgather int16 rows of rank 0")
    scattered = hvd.synchronize(hvd.grouped_reducescatter_async(xs[1:], op=hvd.Sum))
    want = (torch.arange(3 * n) * n + n * (n - 1) // 2)[3 * r:3 * r + 3].to(torch.int16)
    expect(torch.equal(scattered[0], want), f"grouped_reducescatter {scattered[0]} != {want}")


def sparse_and_adasum() -> None:
    r, n = hvd.rank(), hvd.size()
    t = torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([1.0]), (n,),
                                check_invariants=True)
    out = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sp", op=hvd.Sum))
    expect(torch.equal(out.to_dense(), torch.ones(n)), "sparse_allreduce_async")
    e = torch.zeros(n)
    e[r] = 1.0
    ada = hvd.allreduce(e, op=hvd.Adasum)  # orthogonal vectors add up under Adasum
    expect(torch.equal(ada, torch.ones(n)), f"Adasum of orthogonal vectors: {ada}")
    u = hvd.allreduce(torch.tensor([60000, 3], dtype=torch.uint16), op=hvd.Max)
    expect(u.dtype == torch.uint16 and u.tolist() == [60000, 3], "uint16 Max")


def errors() -> None:
    try:
        hvd.allreduce(torch.ones(2 + (hvd.rank() == 1)), name="mismatch")
    except hvd.HorovodInternalError as err:  # Horovod's name catches ringreduce errors
        expect(isinstance(err, hvd.MismatchError), f"mismatch raised {type(err)}")
    else:
        raise AssertionError("mismatched shapes did not raise")


def main() -> None:
    hvd.init()
    set_rank(hvd.rank())
    torch.set_num_threads(1)
    hvd.start_timeline(sys.argv[1])
    grouped()
    hvd.stop_timeline()
    sparse_and_adasum()
    errors()
    hvd.barrier()
    say(f"OK rank {hvd.rank()}")
    hvd.shutdown()


if __name__ == "__main__":
    run(main)
