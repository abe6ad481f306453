"""Runs every collective on every rank and checks the results against numpy.

Each rank can compute every other rank's input (it depends only on the rank),
so each checks its own results locally; at the end the ranks compare hashes of
all results that must be bitwise identical everywhere. Logs a ``layout`` event
(rank, size, local/cross ranks, transport to each peer) and finally
``OK rank <r>``. Any failed check raises, so the process exits non-zero with a
traceback.

    python collectives_worker.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from typing import Any, Callable, Optional, Union

import numpy as np
from workerlib import event, run, say, set_rank, watch_job

import ringreduce as rr

try:
    from ml_dtypes import bfloat16
except ImportError:  # optional test dependency
    bfloat16 = None

FLOATS = [np.float16, np.float32, np.float64] + ([bfloat16] if bfloat16 is not None else [])
INTS = [np.uint8, np.int8, np.int32, np.int64]
OPS = {"Sum": rr.Sum, "Average": rr.Average, "Min": rr.Min, "Max": rr.Max,
       "Product": rr.Product}
BIG_BYTES = 3 << 20
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}

# Labels and digests of results that must be bitwise identical on every rank.
HASHES: list[tuple[str, str]] = []


def record(label: str, arr: np.ndarray) -> None:
    h = hashlib.sha256(f"{arr.dtype.name}{arr.shape}".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
    HASHES.append((label, h.hexdigest()))


def check(cond: bool, label: str, detail: Union[str, Callable[[], str]] = "") -> None:
    """Raise AssertionError naming the rank and check; ``detail`` may be lazy."""
    if not cond:
        raise AssertionError(f"rank {rr.rank()}: {label}: "
                             f"{detail() if callable(detail) else detail}")


def check_equal(got: np.ndarray, want: np.ndarray, label: str) -> None:
    check(got.dtype == want.dtype and got.shape == want.shape, label,
          lambda: f"got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    check(bad.size == 0, label, lambda: f"{bad.size} elements differ, first at {bad[0]}: "
          f"got {got.reshape(-1)[bad[0]]!r}, want {want.reshape(-1)[bad[0]]!r}")


def check_close(got: np.ndarray, want: np.ndarray, rtol: float, label: str) -> None:
    """Bitwise equal if ``rtol`` is 0, else within ``rtol`` relative error."""
    if not rtol:
        return check_equal(got, want, label)
    check(got.dtype == want.dtype and got.shape == want.shape, label,
          lambda: f"got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    check(np.allclose(g, w, rtol=rtol, atol=0), label,
          lambda: f"max abs error {np.max(np.abs(g - w)):.3g}, rtol {rtol:.3g}")


# --------------------------------------------------------------- allreduce
def contribution(rank: int, count: int, dtype: Any, seed: int) -> np.ndarray:
    """Rank r's input: every Sum/Min/Max/Product of these is exact in any dtype."""
    rng = np.random.default_rng([seed, rank, count])
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(count) < 0.7
    if dt.kind == "u":
        return rng.integers(0, 3, count).astype(dt)
    if dt.kind == "i":
        return rng.integers(-2, 3, count).astype(dt)
    # Powers of two: sums of n <= 4 of them and their products are exact even in fp16.
    return rng.choice(np.array([-2, -1, -0.5, 0.5, 1, 2]), count).astype(dt)


def reference(inputs: list[np.ndarray], op: int, dt: np.dtype) -> tuple[np.ndarray, float]:
    """(expected result in dt, relative tolerance) of reducing ``inputs``."""
    n = len(inputs)
    if dt == np.bool_:
        stack = np.stack(inputs)
        return (stack.any(0) if op in (rr.Sum, rr.Max) else stack.all(0)), 0.0
    wide = np.stack([x.astype(np.int64 if dt.kind in "iu" else np.float64) for x in inputs])
    if op == rr.Min:
        out = wide.min(0)
    elif op == rr.Max:
        out = wide.max(0)
    elif op == rr.Product:
        out = wide.prod(0)
    else:
        out = wide.sum(0)
    if op != rr.Average:
        return out.astype(dt), 0.0
    if dt.kind in "iu":  # integers: truncate toward zero
        return (np.sign(out) * (np.abs(out) // n)).astype(dt), 0.0
    if n & (n - 1) == 0:  # dividing by a power of two is exact
        return (out / n).astype(dt), 0.0
    return (out / n).astype(dt), 2.0 * EPS[dt.name]


def check_allreduce(dtype: Any, op_name: str, count: int, seed: int, in_place: bool,
                    named: bool) -> None:
    r, n, dt = rr.rank(), rr.size(), np.dtype(dtype)
    op = OPS[op_name]
    label = f"allreduce{'_' if in_place else ''} {dt.name} {op_name} count={count}"
    name = f"ar.{dt.name}.{op_name}.{count}.{int(in_place)}" if named else None
    mine = contribution(r, count, dt, seed)
    want, rtol = reference([contribution(p, count, dt, seed) for p in range(n)], op, dt)
    if in_place:
        buf = mine.copy()
        got = rr.allreduce_(buf, op=op, name=name)
        check(got is buf, label, lambda: "allreduce_ did not return its argument")
    else:
        before = mine.copy()
        got = rr.allreduce(mine, op=op, name=name)
        check(got is not mine, label, lambda: "allreduce returned its input")
        check_equal(mine, before, label + " (input modified)")
    check_close(got, want, rtol, label)
    record(label, got)


def suite_allreduce(quick: bool) -> None:
    sizes = [0, 1, 7, 100003] if not quick else [0, 1, 7, 20000]
    for dtype in FLOATS + INTS + [np.bool_]:
        dt = np.dtype(dtype)
        ops = [o for o in OPS if not (dt == np.bool_ and o == "Average")]
        for i, op_name in enumerate(ops):
            for j, count in enumerate(sizes):
                check_allreduce(dt, op_name, count, seed=j, in_place=(i + j) % 2 == 0,
                                named=j % 2 == 0)
        if not quick:  # ~3 MB, both forms, fewer ops to keep the run short
            for i, op_name in enumerate(["Sum", "Average", "Max"] if dt != np.bool_ else
                                        ["Sum", "Min"]):
                check_allreduce(dt, op_name, BIG_BYTES // dt.itemsize, seed=9,
                                in_place=i % 2 == 0, named=True)
    if not quick:
        for op_name in OPS:  # every op on a big float32 buffer, the other form
            check_allreduce(np.float32, op_name, BIG_BYTES // 4, seed=10, in_place=True,
                            named=False)
    # prescale / postscale (powers of two keep it exact)
    n = rr.size()
    x = contribution(rr.rank(), 1000, np.float32, 11)
    want = sum(contribution(p, 1000, np.float32, 11).astype(np.float64) * 2 for p in range(n))
    got = rr.allreduce(x, op=rr.Sum, name="scaled", prescale_factor=2.0, postscale_factor=0.25)
    check_equal(got, (want * 0.25).astype(np.float32), "allreduce prescale/postscale")
    record("scaled", got)


# ---------------------------------------------------------------- shared buffers
def suite_shared(quick: bool) -> None:
    """Allreduces over ``shared_zeros`` buffers: the shared path when the ranks of a host
    reach each other over shm and either all are on one host or a host has several (then
    hierarchically), the ring otherwise; the same results either way."""
    r, n = rr.rank(), rr.size()
    comm = rr._comm()
    shm_inside = os.environ.get("RINGREDUCE_TRANSPORT") != "tcp"
    crowded = max(rr.allgather_object(rr.local_size(), name="local sizes")) > 1
    all_shm = n > 1 and shm_inside and (rr.cross_size() == 1 or crowded)
    count = 20000 if quick else BIG_BYTES // 4  # under 4 MiB: main() lowers the threshold
    before = comm._engine.stats()["shared_allreduces"]
    buf = rr.shared_zeros(count, np.float32)
    for seed, op_name in enumerate(["Sum", "Average", "Max"]):
        buf[:] = contribution(r, count, np.float32, 20 + seed)
        want, rtol = reference([contribution(p, count, np.float32, 20 + seed) for p in range(n)],
                               OPS[op_name], np.dtype(np.float32))
        check_close(rr.allreduce_(buf, op=OPS[op_name], name=f"shared.{op_name}"), want, rtol,
                    f"shared allreduce_ {op_name}")
        record(f"shared {op_name}", buf)
    sizes = [count // 2, 5, count - count // 2 - 5]  # views of it, submitted in reverse order
    views = [buf[e - k:e] for k, e in zip(sizes, np.cumsum(sizes))]
    for i, v in enumerate(views):
        v[:] = contribution(r, v.size, np.float32, 30 + i)
    handles = [rr.allreduce_async_(views[i], op=rr.Sum, name=f"shared.view.{i}")
               for i in reversed(range(len(views)))]
    for h in handles:
        rr.synchronize(h)
    for i, v in enumerate(views):
        want, rtol = reference([contribution(p, v.size, np.float32, 30 + i) for p in range(n)],
                               rr.Sum, np.dtype(np.float32))
        check_close(v, want, rtol, f"shared view {i}")
    ran = comm._engine.stats()["shared_allreduces"] - before
    check(ran >= 3 if all_shm else ran == 0, "shared path taken exactly where it applies",
          lambda: f"{ran} shared allreduces (expected: {all_shm})")


# ---------------------------------------------------------------- allgather
def gather_block(rank: int, rows: int, tail: tuple, dtype: Any) -> np.ndarray:
    count = rows * int(np.prod(tail, dtype=np.int64))
    return ((np.arange(count) % 251) + rank).astype(dtype).reshape((rows, *tail))


def suite_allgather(quick: bool) -> None:
    n, r = rr.size(), rr.rank()
    cases = [
        ("small", lambda p: [0, 3, 1, 5][p % 4], (2, 3), np.int32),
        ("fp16", lambda p: p + 1, (), np.float16),
        ("rows0", lambda p: 0, (4,), np.float64),
    ]
    if not quick:
        cases.append(("big", lambda p: 7000 * p + 13, (8,), np.float32))  # ring path
    for label, rows, tail, dtype in cases:
        mine = gather_block(r, rows(r), tail, dtype)
        got = rr.allgather(mine, name=f"ag.{label}")
        want = np.concatenate([gather_block(p, rows(p), tail, dtype) for p in range(n)])
        check_equal(got, want, f"allgather {label}")
        record(f"allgather {label}", got)


# ---------------------------------------------------------------- broadcast
def suite_broadcast(quick: bool) -> None:
    n, r = rr.size(), rr.rank()
    shapes = [(7,), (0,), (3, 5)] + ([] if quick else [(1024, 768)])  # last: ~3 MB, chain
    for root in range(n):
        for k, shape in enumerate(shapes):
            def data(p: int, shape: tuple = shape, k: int = k) -> np.ndarray:
                return contribution(p, int(np.prod(shape)), np.float32, 100 + k).reshape(shape)

            label = f"broadcast root={root} shape={shape}"
            mine = data(r)
            got = rr.broadcast(mine, root_rank=root, name=f"bc.{root}.{k}")
            check_equal(got, data(root), label)
            check_equal(mine, data(r), label + " (input modified)")
            record(label, got)
            buf = data(r)
            out = rr.broadcast_(buf, root, name=f"bc_.{root}.{k}")
            check(out is buf, label, lambda: "broadcast_ did not return its argument")
            check_equal(buf, data(root), label + " in place")


# ------------------------------------------------------------ reducescatter
def suite_reducescatter(quick: bool) -> None:
    n, r = rr.size(), rr.rank()
    for rows, dtype, op_name in [(5 * n + 2, np.float32, "Sum"), (n - 1, np.int32, "Max"),
                                 (3 * n, np.float64, "Average"),
                                 (1000 if quick else 100003, np.float32, "Sum")]:
        dt = np.dtype(dtype)
        label = f"reducescatter {dt.name} {op_name} rows={rows}"
        inputs = [contribution(p, rows * 3, dt, 200 + rows).reshape(rows, 3) for p in range(n)]
        want, rtol = reference(inputs, OPS[op_name], dt)
        base, extra = divmod(rows, n)  # lower ranks get the extra rows
        start = r * base + min(r, extra)
        got = rr.reducescatter(inputs[r], op=OPS[op_name], name=f"rs.{rows}")
        check_close(got, want[start:start + base + (r < extra)], rtol, label)


# ----------------------------------------------------------------- alltoall
def suite_alltoall(quick: bool) -> None:
    n, r = rr.size(), rr.rank()

    def splits_of(p: int, scale: int) -> list[int]:
        return [((p + 2 * q) % 3) * scale for q in range(n)]  # uneven, some zero

    def rows_for(sender: int, dest: int, count: int) -> np.ndarray:
        return np.stack([np.full(count, sender * 1000 + dest), np.arange(count)], axis=1)

    for scale in [1] + ([] if quick else [40000]):  # 40000 rows x 16 B: beyond the small path
        splits = splits_of(r, scale)
        x = np.concatenate([rows_for(r, q, splits[q]) for q in range(n)]).astype(np.int64)
        out, received = rr.alltoall(x, splits=splits, name=f"a2a.{scale}")
        want_splits = np.array([splits_of(p, scale)[r] for p in range(n)], np.int64)
        check_equal(received, want_splits, f"alltoall received splits scale={scale}")
        want = np.concatenate([rows_for(p, r, int(want_splits[p])) for p in range(n)])
        check_equal(out, want.astype(np.int64), f"alltoall uneven scale={scale}")
    even = np.repeat(np.arange(n, dtype=np.float32) + 10 * r, 2)  # 2 rows for each rank
    got = rr.alltoall(even, name="a2a.even")
    check_equal(got, np.repeat(10 * np.arange(n, dtype=np.float32) + r, 2), "alltoall even")


# ------------------------------------------------------- barrier and objects
def suite_barrier() -> None:
    rr.barrier()
    if rr.rank() == 0:
        time.sleep(0.3)
    t0 = time.monotonic()
    rr.barrier(name="late-root")
    waited = time.monotonic() - t0
    if rr.rank() != 0:
        check(waited > 0.15, "barrier", lambda: f"returned after {waited:.3f} s although "
              "rank 0 entered it 0.3 s late")


def suite_objects() -> None:
    n, r = rr.size(), rr.rank()
    for root in range(n):
        obj = {"root": r, "payload": list(range(3 * r)), "text": "é" * r}
        got = rr.broadcast_object(obj, root_rank=root, name=f"obj.{root}")
        want = {"root": root, "payload": list(range(3 * root)), "text": "é" * root}
        check(got == want, f"broadcast_object root={root}", f"{got!r} != {want!r}")
    got = rr.allgather_object((r, "x" * r, None))
    want = [(p, "x" * p, None) for p in range(n)]
    check(got == want, "allgather_object", f"{got!r} != {want!r}")


# --------------------------------------------------------------------- main
def layout() -> dict:
    from ringreduce import _Process  # the default Communicator, for transport_to()

    comm = _Process.comm
    return {"rank": rr.rank(), "size": rr.size(), "local_rank": rr.local_rank(),
            "local_size": rr.local_size(), "cross_rank": rr.cross_rank(),
            "cross_size": rr.cross_size(),
            "transports": {p: comm.transport_to(p) for p in range(rr.size()) if p != rr.rank()}}


def compare_hashes() -> None:
    everyone = rr.allgather_object(HASHES, name="hashes")
    for p, theirs in enumerate(everyone):
        check(len(theirs) == len(HASHES), "hash lists",
              lambda theirs=theirs, p=p: f"rank {p} has {len(theirs)} results, we have "
              f"{len(HASHES)}")
        for (label, mine), (their_label, their_hash) in zip(HASHES, theirs):
            check(label == their_label and mine == their_hash, f"{label} bitwise identical",
                  lambda p=p: f"differs on rank {p}")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small sizes only")
    args = p.parse_args(argv)
    watch_job()
    # The shared-buffer suite's buffers are smaller than the default threshold.
    os.environ.setdefault("RINGREDUCE_SHARED_MIN_BYTES", "0")
    rr.init()
    set_rank(rr.rank())
    event("layout", **layout())
    t0 = time.monotonic()
    for suite in (suite_allreduce, suite_shared, suite_allgather, suite_broadcast,
                  suite_reducescatter, suite_alltoall):
        suite(args.quick)
    suite_barrier()
    suite_objects()
    compare_hashes()
    from ringreduce import _Process

    stats = _Process.comm._engine.stats()
    event("done", seconds=time.monotonic() - t0, results=len(HASHES),
          hierarchical=stats["hierarchical_allreduces"],
          hierarchical_allgathers=stats["hierarchical_allgathers"])
    rank = rr.rank()
    rr.shutdown()
    say(f"OK rank {rank}")


if __name__ == "__main__":
    run(main)
