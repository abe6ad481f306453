"""Folded rounds (csrc/coordination/engine_fold.cc): a small host allreduce that every
worker submitted alone in a round is reduced by rank 0 within the negotiation round and
its result rides back with the response, saving the header-and-data exchange. Paired
rounds (engine_pair.cc): in a two-rank job rank 0's POLL carries its contribution to a
repeated call, and neither side waits for a response. These tests run threads as ranks
and compare every folded and paired result bitwise with the ordinary path
(``RINGREDUCE_FOLD_BYTES=0``, ``RINGREDUCE_PAIRED_ROUNDS=0``), and check that both step
aside wherever they must.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import env

import ringreduce as rr
from ringreduce.process_sets import ProcessSet
from ringreduce.testing import make_world, run_threaded

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]
OPS = [rr.Sum, rr.Average, rr.Min, rr.Max, rr.Product]


def run(n, body, fold_bytes, timeout=60, **settings):
    with env(RINGREDUCE_FOLD_BYTES=str(fold_bytes), **settings):
        w = make_world(n)
    try:
        return run_threaded(n, body, world=w, timeout=timeout)
    finally:
        for c in w:
            c.close()


def folded(c) -> int:
    return c._engine.stats()["folded"]


def paired(c) -> int:
    return c._engine.stats()["paired"]


def inputs(rank, dtype, count):
    rng = np.random.default_rng(rank)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(count) * 3).astype(dtype)
    return rng.integers(1, 4, count).astype(dtype)


def cases():
    for dtype in DTYPES:
        for op in OPS:
            if np.dtype(dtype).kind in "iu" and op == rr.Average:
                continue
            yield dtype, op


def every_case(c):
    """Blocking allreduces of every dtype and op, with scales, in place and out of place;
    returns the results and how many of them were folded."""
    r, before = c.rank(), folded(c)
    out = []
    for i, (dtype, op) in enumerate(cases()):
        for count in (0, 1, 5, 37):
            x = inputs(r + 10 * i, dtype, count)
            keep = x.copy()
            scales = {} if np.dtype(dtype).kind in "iu" else dict(prescale_factor=0.5,
                                                                  postscale_factor=3.0)
            out.append(c.allreduce(x, op=op, name=f"t{i}.{count}", **scales))
            assert np.array_equal(x, keep), "out of place changed its input"
            y = x.copy()
            c.allreduce_(y, op=op, **scales)  # unnamed, in place
            out.append(y)
    return out, folded(c) - before


@pytest.mark.parametrize("n", [2, 3])
def test_folded_results_equal_the_ordinary_path_bitwise(n):
    on = run(n, every_case, 1024)
    off = run(n, every_case, 0)
    calls = len(on[0][0])
    for r in range(n):
        assert on[r][1] == calls, f"rank {r} folded {on[r][1]} of {calls} calls"
        assert off[r][1] == 0, off[r][1]
        for a, b in zip(on[r][0], off[r][0]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (a, b)
        for a, b in zip(on[r][0], on[0][0]):
            assert a.tobytes() == b.tobytes(), "ranks disagree"


def test_a_late_rank_still_folds_and_larger_calls_do_not():
    """A worker's contribution waits at rank 0 while rank 0 is late (and the other way
    round); a call above RINGREDUCE_FOLD_BYTES takes the ordinary path."""

    def body(c):
        r, res = c.rank(), []
        for i in range(6):
            if (i % 2) == (r % 2):
                time.sleep(0.05)  # ranks take turns being late
            res.append(c.allreduce(np.full(4, r + i, np.float32), op=rr.Sum, name="late"))
        n_small = folded(c)
        big = c.allreduce(np.ones(300, np.float32), op=rr.Sum, name="big")  # 1200 B
        return res, n_small, folded(c) - n_small, big

    for r, (res, n_small, n_big, big) in enumerate(run(2, body, 1024)):
        assert [x.tolist() for x in res] == [[2.0 * i + 1] * 4 for i in range(6)], res
        assert n_small == 6 and n_big == 0, (r, n_small, n_big)
        assert (big == 2).all()


def test_fused_grouped_sets_and_joins_take_the_ordinary_path():
    """Folding steps aside for grouped calls, process sets and a joined rank, and the
    results stay right; a mismatch still fails on every rank and the job goes on."""

    def body(c):
        ps = ProcessSet([0, 1])
        c.process_sets.setup([ps])  # its own small collectives fold: counted from here
        r, before = c.rank(), folded(c)
        got = c.grouped_allreduce([np.full(2, r, np.float32), np.ones(3)], op=rr.Sum)
        with rr.use_communicator(c):
            in_set = rr.allreduce(np.full(2, r + 1.0), op=rr.Sum, process_set=ps)
        err = None
        try:
            c.allreduce(np.ones(2 + r, np.float32), name="mm")
        except rr.MismatchError as e:
            err = e
        after_mismatch = c.allreduce(np.full(2, 1.0), op=rr.Sum, name="mm")
        n = folded(c) - before
        extra = [c.allreduce(np.full(2, 5.0), op=rr.Sum) for _ in range(2 if r == 0 else 0)]
        last = c.join()
        return got, in_set, err, after_mismatch, n, folded(c) - before - n, extra, last

    for r, (got, in_set, err, after, n, n_joined, extra, last) in enumerate(run(2, body, 1024)):
        assert (got[0] == 1).all() and (got[1] == 2).all(), got
        assert (in_set == 3).all(), in_set
        assert isinstance(err, rr.MismatchError) and "float32[3]" in str(err), err
        assert (after == 2).all(), after
        assert n == 1, f"rank {r}: only the allreduce after the mismatch folds, got {n}"
        assert n_joined == 0, "a call while a rank has joined must not fold"
        assert [e.tolist() for e in extra] == ([[5.0, 5.0]] * 2 if r == 0 else []), extra
        assert last == 0, last


def test_barriers_fold_and_still_wait_for_the_last_rank():
    def body(c):
        r, before, waited = c.rank(), folded(c), []
        for i in range(4):
            if r == i % 2:
                time.sleep(0.1)
            t0 = time.perf_counter()
            c.barrier()
            waited.append(time.perf_counter() - t0)
        return folded(c) - before, waited

    for r, (n, waited) in enumerate(run(2, body, 1024)):
        assert n == 4, f"rank {r} folded {n} of 4 barriers"
        early = [w for i, w in enumerate(waited) if r != i % 2]
        assert min(early) > 0.05, f"rank {r} left barriers early: {waited}"


# ------------------------------------------------------------------ paired rounds
# A long hold (RINGREDUCE_SPIN_US) so that a loaded machine still pairs most calls.
PAIR = dict(RINGREDUCE_SPIN_US="20000")


def twice(c):
    """every_case twice: the second pass finds its named calls in the response cache."""
    every_case(c)
    before = paired(c)
    out, _ = every_case(c)
    return out, paired(c) - before


def test_paired_results_equal_the_unpaired_path_bitwise():
    on = run(2, twice, 1024, **PAIR)
    off = run(2, twice, 1024, RINGREDUCE_PAIRED_ROUNDS="0", **PAIR)
    for r in range(2):
        assert on[r][1] > 0, f"rank {r}: no call was paired"
        assert off[r][1] == 0, off[r][1]
        for a, b in zip(on[r][0], off[r][0]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (a, b)
        for a, b in zip(on[r][0], on[0][0]):
            assert a.tobytes() == b.tobytes(), "ranks disagree"
    assert on[0][1] == on[1][1], "ranks counted different paired calls"


def test_paired_calls_keep_any_order_mismatches_and_joins():
    """Two threads per rank call two cached names in whatever order they get to; a
    mismatch on a cached name fails both ranks and the name pairs again after it; a
    joined rank contributes zeros; ranks late in turn outlast the hold."""
    import threading

    def body(c):
        r, res = c.rank(), {}

        def loop(name):
            res[name] = [c.allreduce(np.full(3, r + 1.0), op=rr.Sum, name=name)
                         for _ in range(30)]

        threads = [threading.Thread(target=loop, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(3):
            c.allreduce(np.ones(4, np.float32), name="m")
        err = None
        try:
            c.allreduce(np.ones(4 + r, np.float32), name="m")
        except rr.MismatchError as e:
            err = e
        before = paired(c)
        again = [c.allreduce(np.full(4, r + 2.0, np.float32), op=rr.Sum, name="m")
                 for _ in range(5)]
        again_paired = paired(c) - before
        late = []
        for i in range(4):
            if i % 2 == r:
                time.sleep(0.05)  # beyond the hold: the other rank's round runs empty
            late.append(c.allreduce(np.full(2, 1.0), op=rr.Sum, name="late"))
        alone = [c.allreduce(np.full(2, 7.0), op=rr.Sum, name="m2") for _ in range(3 if r == 0
                                                                                 else 0)]
        return res, err, again, again_paired, late, alone, c.join()

    for r, (res, err, again, again_paired, late, alone, last) in enumerate(
            run(2, body, 1024, **PAIR)):
        for name in ("a", "b"):
            assert all((x == 3).all() for x in res[name]), (name, res[name])
        assert isinstance(err, rr.MismatchError) and "float32[5]" in str(err), err
        assert all((x == 5).all() for x in again), again
        assert again_paired > 0, f"rank {r}: the name did not pair again after the mismatch"
        assert all((x == 2).all() for x in late), late
        assert [x.tolist() for x in alone] == ([[7.0, 7.0]] * 3 if r == 0 else []), alone
        assert last == 0, last


def test_barriers_pair_and_three_ranks_do_not():
    """(The test above checks that a barrier still waits for the last rank.)"""

    def body(c):
        r = c.rank()
        for _ in range(3):
            c.allreduce(np.ones(2), name="x")
        before = paired(c)
        for _ in range(20):
            c.barrier()
        n_barriers = paired(c) - before
        x = [c.allreduce(np.full(2, r + 1.0), op=rr.Sum, name="x") for _ in range(10)]
        return n_barriers, x, paired(c), folded(c)

    two = run(2, body, 1024, **PAIR)
    assert all((v == 3).all() for _, x, _, _ in two for v in x)
    assert two[0][0] == two[1][0] > 0, f"barriers paired: {[v[0] for v in two]}"
    for r, (_, x, n_paired, n_folded) in enumerate(run(3, body, 1024, **PAIR)):
        assert all((v == 6).all() for v in x)
        assert n_paired == 0 and n_folded > 0, (r, n_paired, n_folded)


# ------------------------------------------- broadcasts, allgathers and the object calls
MOVE_DTYPES = ["float32", "float64", "float16", "int8", "uint8", "bool"]
BIG_OBJECT = {"weights": list(range(600)), "tag": "x" * 300}  # pickles to > 1 KiB


def movement(c):
    """Blocking broadcasts (in place and not, every root) and allgathers (ragged, empty,
    2-D, of empty rows) of every dtype, and the object calls small and large. Returns
    the results, how many calls were folded and paired, and how many should fold."""
    r, n = c.rank(), c.size()
    f0, p0, out, due = folded(c), paired(c), [], 0
    for i, dtype in enumerate(MOVE_DTYPES):
        size = np.dtype(dtype).itemsize
        for count in (0, 1, 5, 37):
            root = (i + count) % n
            x = inputs(r + 7 * i, dtype, count)
            out.append(c.broadcast_(x, root, name=f"b{i}.{count}"))
            out.append(c.broadcast(inputs(r + 11, dtype, count).reshape(-1, 1), root))
            out.append(c.allgather(inputs(r, dtype, count + r), name=f"g{i}.{count}"))
            out.append(c.allgather(inputs(r + 3, dtype, 3 * count).reshape(count, 3)))
            # an allgather folds while its whole result is at most twice the limit
            due += 2 + (sum(count + q for q in range(n)) * size <= 2048) + (
                n * 3 * count * size <= 2048)
    out.append(c.allgather(np.zeros((2, 0), np.float32)))  # empty rows: not foldable
    objs = [c.broadcast_object({"rank": r, "i": i}, i % n) for i in range(3)]
    objs += [c.broadcast_object(BIG_OBJECT if r == 1 else None, 1, name="big")]
    objs += [c.allgather_object(("rank", r) if r else BIG_OBJECT) for _ in range(2)]
    # Every broadcast_object's head and the big one's rest (870 B); not the allgather_objects,
    # as rank 0's pickle (1.9 KiB) is above the limit.
    due += 3 + 2
    return out, objs, folded(c) - f0, paired(c) - p0, due


@pytest.mark.parametrize("n", [2, 3])
def test_broadcasts_and_allgathers_fold_bitwise(n):
    on = run(n, movement, 1024)
    off = run(n, movement, 0)
    expect_objs = ([{"rank": i % n, "i": i} for i in range(3)] + [BIG_OBJECT]
                   + [[BIG_OBJECT] + [("rank", q) for q in range(1, n)]] * 2)
    for r in range(n):
        out, objs, n_folded, _, due = on[r]
        assert n_folded == due, f"rank {r} folded {n_folded} calls where {due} were due"
        assert off[r][2] == 0, off[r][2]
        assert objs == expect_objs and off[r][1] == expect_objs, objs
        for a, b in zip(out, off[r][0]):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        for a, b in zip(out, on[0][0]):
            assert a.tobytes() == b.tobytes(), "ranks disagree"
    # the ragged allgather of the first dtype and count 5: rank q sent 5 + q rows
    ragged = on[0][0][4 * 2 + 2]
    assert ragged.shape == (sum(5 + q for q in range(n)),), ragged.shape


def test_broadcasts_and_allgathers_pair_and_step_aside():
    """Twice through `movement`: the second pass pairs from the cache; mismatched roots
    and dtypes still fail on both ranks; an allgather while a rank has joined is right."""

    def body(c):
        movement(c)
        out, objs, _, n_paired, _ = movement(c)
        errs = []
        for kw in ({"root": c.rank()}, {"dtype": ["float32", "int32"][c.rank()]}):
            try:
                if "root" in kw:
                    c.broadcast_(np.ones(3), kw["root"], name="mm")
                else:
                    c.allgather(np.ones(2, kw["dtype"]), name="mm")
            except rr.MismatchError as e:
                errs.append(e)
        after = c.broadcast(np.full(2, c.rank() + 1.0), 1, name="mm")
        if c.rank() == 0:
            gathered = [c.allgather(np.full(2, 4.0)) for _ in range(2)]
        else:
            gathered = []
        return out, objs, n_paired, errs, after, gathered, c.join()

    on = run(2, body, 1024, **PAIR)
    off = run(2, body, 1024, RINGREDUCE_PAIRED_ROUNDS="0", **PAIR)
    assert on[0][2] == on[1][2] > 0, f"paired: {[v[2] for v in on]}"
    for r in range(2):
        out, objs, _, errs, after, gathered, last = on[r]
        assert off[r][2] == 0
        for a, b in zip(out, off[r][0]):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        assert objs == off[r][1]
        assert len(errs) == 2 and "root" in str(errs[0]) and "int32" in str(errs[1]), errs
        assert after.tolist() == [2.0, 2.0], after
        assert [g.tolist() for g in gathered] == ([[4.0, 4.0]] * 2 if r == 0 else []), gathered
        assert last == 0, last
