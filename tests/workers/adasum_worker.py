"""Adasum in real processes (a power-of-two job): the engine's vector-halving exchange.

    RANK=r WORLD_SIZE=2 ... python adasum_worker.py  (or mpirun -np 2)

Checks an allreduce past one transport chunk and a fused group of tensors with norms far
apart against ``adasum_tree`` (float64), and that the engine's ``adasum_allreduces``
stat counted both calls. numpy only (no framework import: it starts fast). Logs
``OK rank <r>`` at the end.
"""

from __future__ import annotations

import numpy as np
from workerlib import run, say, set_rank, watch_job

import ringreduce as rr
from ringreduce._adasum import adasum_tree


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {rr.rank()}: {what}")


def vector(rank: int, count: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(count) * scale


def main() -> None:
    watch_job()
    rr.init()
    set_rank(rr.rank())
    r, n = rr.rank(), rr.size()
    comm = rr._comm()
    check(n & (n - 1) == 0, f"needs a power-of-two job, got {n}")
    before = comm._engine.stats()["adasum_allreduces"]
    big = 300_001  # float64: past one transport chunk
    out = rr.allreduce(vector(r, big), op=rr.Adasum, name="big")
    want = adasum_tree([vector(q, big) for q in range(n)])
    check(np.allclose(out, want, rtol=1e-10, atol=1e-12), "allreduce")
    sizes, scales = (7, 3), (1000.0, 1e-3)
    xs = [vector(r + i * n, sizes[i], scales[i]) for i in range(2)]
    got = rr.grouped_allreduce(xs, op=rr.Adasum, name="group")
    for i, g in enumerate(got):
        w = adasum_tree([vector(q + i * n, sizes[i], scales[i]) for q in range(n)])
        check(np.allclose(g, w, rtol=1e-10, atol=1e-15), f"grouped member {i}")
    runs = comm._engine.stats()["adasum_allreduces"] - before
    check(runs == 2, f"engine Adasum ran {runs} times, expected 2")
    rr.shutdown()
    say(f"OK rank {r}")


if __name__ == "__main__":
    run(main)
