"""Hierarchical allreduce (csrc/collectives/allreduce_hierarchical.cc): threads as ranks on
fake hosts (``host_ids``: shm inside a host, TCP across), against the flat ring's results,
over every dtype and op the flat ring supports, odd sizes and hosts with unequal rank counts.
Real processes run it in tests/test_multiprocess.py's two-host launch."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import env
from test_threaded_collectives import check_sweep, sweep

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

# No direct path and small slots: every size above zero takes the ring, in several chunks.
SMALL = {"RINGREDUCE_SMALL_BYTES": "0", "RINGREDUCE_SHM_SLOT_BYTES": "4096"}
LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "interleaved": ["a", "b", "a", "b"],
    "uneven-3+1": ["a", "a", "a", "b"],
    "uneven-1+2+3": ["c", "b", "b", "a", "a", "a"],
}


def hierarchical_count(comm) -> int:
    return comm._engine.stats()["hierarchical_allreduces"]


def run_sweep(hosts: list, setting: str) -> tuple:
    """The sweep's results and how many allreduces ran hierarchically, per rank."""
    n = len(hosts)
    with env(RINGREDUCE_HIERARCHICAL_ALLREDUCE=setting, **SMALL):
        comms = make_world(n, hosts)
    try:
        def body(c):
            before = hierarchical_count(c)
            return sweep(c, n), hierarchical_count(c) - before
        out = run_threaded(n, body, world=comms)
    finally:
        for c in comms:
            c.close()
    return [r for r, _ in out], [k for _, k in out]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_flat_ring(layout):
    hosts = LAYOUTS[layout]
    n = len(hosts)
    hier, ran = run_sweep(hosts, "1")
    check_sweep(hier, n)  # every rank identical, and right against float64 (exact for ints)
    assert min(ran) > 0 and ran == [ran[0]] * n, ran
    if layout != "2x2":
        return  # the flat ring does not care where ranks live: compare it once
    flat, ran_flat = run_sweep(hosts, "0")
    assert ran_flat == [0] * n
    for key, got in hier[0].items():
        if np.dtype(key[1]).kind in "iub" or key[2] in (rr.Min, rr.Max):
            assert got.tobytes() == flat[0][key].tobytes(), key  # exact: order cannot matter


def test_fused_tensors_in_place_and_automatic_choice():
    """Fused in-place (segmented) allreduces take the hierarchical path when it is left
    to choose (the default: several hosts, shm inside each); a forced-TCP world does not."""
    hosts = LAYOUTS["interleaved"]

    def body(c):
        xs = [np.arange(k, dtype=np.float32) * (c.rank() + 1) for k in (3, 50001, 7, 20000)]
        before = hierarchical_count(c)
        hs = [c.allreduce_async_(x, op=rr.Average, name=f"t{i}") for i, x in enumerate(xs)]
        for h in hs:
            h.wait()
        return xs, hierarchical_count(c) - before

    for settings, expect_hier in (({}, True), ({"RINGREDUCE_TRANSPORT": "tcp"}, False)):
        with env(**settings):
            comms = make_world(4, hosts)
        try:
            out = run_threaded(4, body, world=comms)
        finally:
            for c in comms:
                c.close()
        for xs, ran in out:
            assert (ran > 0) == expect_hier, (settings, ran)
            for x, k in zip(xs, (3, 50001, 7, 20000)):
                np.testing.assert_array_equal(x, np.arange(k, dtype=np.float32) * 2.5)


def test_mixed_wishes_fall_back_to_the_flat_ring():
    """The choice rides in the allreduce header: one rank that sets 0 makes all ranks run
    the flat ring, instead of the ranks running different algorithms."""
    wishes = [{"RINGREDUCE_HIERARCHICAL_ALLREDUCE": w, **SMALL} for w in "1101"]
    comms = make_world(4, LAYOUTS["2x2"], rank_env=wishes)
    try:
        out = run_threaded(4, lambda c: (c.allreduce(np.full(999, c.rank() + 1, np.int32),
                                                     op=rr.Sum), hierarchical_count(c)),
                           world=comms)
    finally:
        for c in comms:
            c.close()
    for x, ran in out:
        assert ran == 0
        np.testing.assert_array_equal(x, np.full(999, 10, np.int32))


@pytest.mark.parametrize("layout", ["2x2", "uneven-3+1"])
def test_out_of_place_reads_the_input_where_it_lies(layout):
    """``allreduce`` (a new array) runs hierarchically on the input as it lies (the ring's
    ``own``; a rank alone on its host copies it): the input is unchanged, the result right."""
    hosts = LAYOUTS[layout]
    n = len(hosts)
    with env(RINGREDUCE_HIERARCHICAL_ALLREDUCE="1", **SMALL):
        comms = make_world(n, hosts)

    def body(c):
        x = np.arange(30001, dtype=np.float64) * (c.rank() + 1)
        keep = x.copy()
        before = hierarchical_count(c)
        out = c.allreduce(x, op=rr.Sum)
        return np.array_equal(x, keep), out, hierarchical_count(c) - before

    try:
        res = run_threaded(n, body, world=comms)
    finally:
        for c in comms:
            c.close()
    want = np.arange(30001, dtype=np.float64) * (n * (n + 1) // 2)
    for unchanged, out, ran in res:
        assert unchanged and ran == 1
        np.testing.assert_array_equal(out, want)


def shared_count(comm) -> int:
    return comm._engine.stats()["shared_allreduces"]


@pytest.mark.parametrize("layout", ["2x2", "uneven-1+2+3"])
def test_shared_buffers_on_several_hosts_reduce_where_they_lie(layout):
    """``shared_zeros`` on a job of several hosts: memory shared within each host, and an
    allreduce over it (one view, then fused views: segments) reads the host peers' data
    where it lies, rings across hosts and writes the result into the host's buffers."""
    hosts = LAYOUTS[layout]
    n = len(hosts)
    sizes = (70001, 3, 20000)
    with env(RINGREDUCE_HIERARCHICAL_ALLREDUCE="1", RINGREDUCE_SHARED_MIN_BYTES="0", **SMALL):
        comms = make_world(n, hosts)

    def body(c):
        buf = c.shared_zeros(sum(sizes), np.float64)
        views = np.split(buf, np.cumsum(sizes)[:-1])
        before = (shared_count(c), hierarchical_count(c))
        buf[:] = np.arange(buf.size) % 1000 * (c.rank() + 1)
        c.allreduce_(buf, op=rr.Average, name="whole")
        whole = buf.copy()
        for i, v in enumerate(views):
            v[:] = (i + 1) * (c.rank() + 1)
        hs = [c.allreduce_async_(v, op=rr.Sum, name=f"v{i}") for i, v in enumerate(views)]
        for h in hs:
            h.wait()
        return whole, [v.copy() for v in views], (shared_count(c) - before[0],
                                                 hierarchical_count(c) - before[1])

    try:
        res = run_threaded(n, body, world=comms)
    finally:
        for c in comms:
            c.close()
    total = n * (n + 1) // 2
    for whole, views, (shared, hier) in res:
        np.testing.assert_array_equal(whole, np.arange(sum(sizes)) % 1000 * total / n)
        for i, v in enumerate(views):
            np.testing.assert_array_equal(v, (i + 1) * total)
        assert shared >= 2 and hier == shared, (shared, hier)  # fused or not: every one


# ------------------------------------------------------------ hierarchical allgather
def gathered(c, k):
    """Allgather cases for rank c.rank(): ragged rows (some ranks empty), several dtypes."""
    r = c.rank()
    return [
        np.arange((3 * r + k) * 5, dtype=np.float32).reshape(3 * r + k, 5) + 1000 * r,
        np.full((r % 2) * 700 + 1, r, dtype=np.int8),  # odd byte counts
        np.arange(r * 64, dtype=np.float64),  # rank 0 gives no rows
    ]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hierarchical_allgather_matches_the_flat_ring(layout):
    """RINGREDUCE_HIERARCHICAL_ALLGATHER=1 (csrc/collectives/allgather_hierarchical.cc): host
    gather, leaders' ring, host broadcast; bytes identical to the flat ring's on every layout,
    grouped calls too."""
    hosts = LAYOUTS[layout]
    n = len(hosts)

    def body(c):
        before = c._engine.stats()["hierarchical_allgathers"]
        single = [c.allgather(x, name=f"ag{i}") for i, x in enumerate(gathered(c, 2))]
        grouped = c.grouped_allgather(gathered(c, 0), name="group")
        return single, grouped, c._engine.stats()["hierarchical_allgathers"] - before

    results = {}
    for setting in ("1", "0"):
        with env(RINGREDUCE_HIERARCHICAL_ALLGATHER=setting, **SMALL):
            comms = make_world(n, hosts)
        try:
            results[setting] = run_threaded(n, body, world=comms)
        finally:
            for c in comms:
                c.close()
    for (single, grouped, ran), (flat_single, flat_grouped, flat_ran) in zip(results["1"],
                                                                              results["0"]):
        assert ran == 3 + 3 and flat_ran == 0  # the grouped call: one allgather per tensor
        for got, want in zip(single + grouped, flat_single + flat_grouped):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    first = results["1"][0][0][0]
    assert first.shape == (sum(3 * r + 2 for r in range(n)), 5)
    np.testing.assert_array_equal(first[:2], np.arange(10, dtype=np.float32).reshape(2, 5))
