"""Threaded tier of the engine: N ranks as threads over real shm/TCP links,
submitting asynchronously, in different orders, with fusion, the response
cache, the stall inspector and the timeline (join: tests/test_engine_join.py)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time

import numpy as np
import pytest
from conftest import env, world

import ringreduce as rr
from ringreduce import _core
from ringreduce.testing import make_world, run_threaded


def grads(rank, count=12, seed=0):
    """Integer-valued float32 tensors of mixed sizes: sums are exact in any order."""
    rng = np.random.default_rng(seed * 100 + rank)
    sizes = [1, 7, 300, 5000, 70000, 3, 200000, 64, 1000, 9, 40000, 2][:count]
    return [rng.integers(-50, 50, s).astype(np.float32) for s in sizes]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_async_submissions_in_different_orders(n):
    def body(c):
        gs = grads(c.rank())
        order = list(range(len(gs)))
        np.random.default_rng(c.rank()).shuffle(order)  # each rank its own order
        hs = {i: c.allreduce_async(gs[i], op=rr.Sum, name=f"g{i}") for i in order}
        return [rr.synchronize(hs[i]) for i in range(len(gs))]

    results = run_threaded(n, body)
    want = [sum(grads(r)[i] for r in range(n)) for i in range(len(grads(0)))]
    for res in results:
        for got, exp in zip(res, want):
            np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("n", [2, 3])
def test_fused_and_unfused_results_are_identical(n):
    def run(threshold, data):
        w = world(n, RINGREDUCE_FUSION_THRESHOLD=threshold)

        def body(c):
            hs = [c.allreduce_async(x, op=rr.Average, name=f"t{i}", prescale_factor=0.5)
                  for i, x in enumerate(data(c.rank()))]
            return [h.wait() for h in hs]

        return run_threaded(n, body, world=w, timeout=60)[0], w

    def exact(r):
        return grads(r)

    def noisy(r):  # arbitrary floats: at n = 2, a + b == b + a bit for bit
        rng = np.random.default_rng(r)
        return [rng.standard_normal(s).astype(np.float32) for s in (5, 4000, 70000, 11)]

    for data in [exact] + ([noisy] if n == 2 else []):
        fused, w1 = run(64 << 20, data)
        alone, w2 = run(0, data)
        for a, b in zip(fused, alone):
            np.testing.assert_array_equal(a, b)
        for c in w1 + w2:
            c.close()


def test_grouped_allreduce_and_poll():
    def body(c):
        xs = [np.full(s, c.rank() + 1, np.float64) for s in (3, 100000, 1)]
        h = rr_grouped(c, xs)
        seen_pending = not h.done()
        out = h.wait()
        assert h.done()
        return seen_pending, [o.tolist()[:2] for o in out]

    res = run_threaded(2, body)
    for _, out in res:
        assert out == [[3.0, 3.0], [3.0, 3.0], [3.0]]


def rr_grouped(c, xs):
    return c.grouped_allreduce_async(xs, op=rr.Sum, name="grp")


def test_grouped_in_place_fast_and_general_paths_agree():
    """A list or tuple of plain arrays is submitted by C++ (grouped_allreduce_arrays), one
    holding anything else by the Python path; unnamed groups get the same names on every
    rank whichever path each rank took, and the results are the same."""

    def body(c):
        r = c.rank()

        def fresh():
            return [np.full(s, r + 1, dt) for s, dt in ((3, np.float32), (70000, np.float64),
                                                       (1, np.int32), ((2, 5), np.int64))]

        fast = fresh()
        probe = fresh()  # the raw handle does not hold the arrays: the caller must
        taken = c._engine.grouped_allreduce_arrays(tuple(probe), rr.Sum, "probe", 1.0, 1.0)
        taken.wait()  # the C++ path takes such a tuple (None would mean: general path)
        assert probe[1][0] == 3.0
        for refused in ((np.ones(4)[::2],), (), [np.ones(3)]):  # a list could lose members
            assert c._engine.grouped_allreduce_arrays(refused, rr.Sum, "x", 1.0, 1.0) is None
        # Unnamed, twice: rank 0 through C++ (a list, then a tuple), rank 1 through Python
        # (a member that is a buffer but not an ndarray sends the whole group there).
        outs = []
        for kind in (list, tuple):
            xs = fresh()
            arg = kind(xs) if r == 0 else xs[:-1] + [memoryview(xs[-1])]
            out = c.grouped_allreduce_async_(arg, op=rr.Sum, prescale_factor=2.0).wait()
            outs.append([np.asarray(o) for o in out])
        done = c.grouped_allreduce_async_(fast, op=rr.Average).wait()
        assert all(o is x for o, x in zip(done, fast))
        # A buffer that is not an ndarray sends the whole group the general way.
        views = [np.arange(6.0)[::2].copy(), memoryview(np.array([1.0, 2.0]))]
        mixed = c.grouped_allreduce_async_(views, op=rr.Sum, name="mixed").wait()
        return [[o.tolist() for o in out] for out in outs], [f.tolist() for f in fast], \
            [np.asarray(m).tolist() for m in mixed]

    res = run_threaded(2, body)
    (outs0, fast0, mixed0), (outs1, fast1, mixed1) = res
    assert outs0 == outs1 and fast0 == fast1 and mixed0 == mixed1
    assert outs0[0][0] == [6.0] * 3 and outs0[1][3] == [[6] * 5] * 2  # (1 + 2) * prescale 2
    assert fast0[1][:2] == [1.5, 1.5] and fast0[2] == [1]  # int Average: floor(3 / 2)
    assert mixed0 == [[0.0, 4.0, 8.0], [2.0, 4.0]]


def test_grouped_in_place_runs_as_one_unit_with_fusion_off():
    """Both paths mark the members as one group: one response even with fusion off."""

    def body(c):
        counts = []
        for path in ("cpp", "general"):
            xs = [np.full(n, c.rank() + 1.0, np.float32) for n in (5, 70000, 3)]
            arg = xs if path == "cpp" else xs[:-1] + [memoryview(xs[-1])]
            before = c._engine.stats()["responses"]
            c.grouped_allreduce_async_(arg, op=rr.Sum, name=f"one.{path}").wait()
            counts.append(c._engine.stats()["responses"] - before)
            assert all((x == 3.0).all() for x in xs)
        return counts

    assert run_threaded(2, body, world=world(2, RINGREDUCE_FUSION_THRESHOLD="0")) == [[1, 1]] * 2


def test_grouped_in_place_keeps_its_arrays_whatever_the_caller_does_to_its_list():
    import weakref

    def body(c):
        xs = [np.full(200000, c.rank() + 1.0, np.float32) for _ in range(3)]
        refs = [weakref.ref(x) for x in xs]
        first = xs[0]  # kept by the test, to read the result
        h = c.grouped_allreduce_async_(xs, op=rr.Sum, name="kept")
        xs.clear()  # the caller's list no longer holds them: the handle must
        gc.collect()
        alive = all(r() is not None for r in refs)
        out = h.wait()  # the arrays reduced, whatever the list holds now
        assert len(out) == 3 and out[0] is first
        del out
        return alive, float(first[-1])

    assert run_threaded(2, body) == [(True, 3.0)] * 2


def test_finished_collectives_do_not_keep_their_arrays():
    """The communicator keeps a handle's buffers alive while its collective runs; once it
    has been waited for, dropping the array (and the handle) must free it, on every path."""
    import weakref

    def body(c):
        x = np.full(1000, c.rank() + 1.0, np.float32)
        refs = [weakref.ref(x)]
        h = c.allreduce_async_(x, op=rr.Sum, name="in-place")  # the C++ hot path
        rr.synchronize(h)
        del x, h
        y = np.ones(1000, np.float32)
        out = c.allreduce(y, op=rr.Sum, name="blocking")  # out of place, blocking
        refs += [weakref.ref(y), weakref.ref(out)]
        del y, out
        z = np.ones(1000, np.float32).reshape(10, 100)[:, :50]  # the general path
        h = c.allreduce_async(z, op=rr.Sum, name="general")
        out = h.wait()
        c.release_done()
        refs += [weakref.ref(z), weakref.ref(out)]
        del z, out, h
        gc.collect()
        return [r() is None for r in refs]

    assert run_threaded(2, body) == [[True] * 5] * 2


def test_grouped_in_place_errors_keep_their_context():
    """What the C++ path leaves alone is refused by the general path, with its words."""

    def body(c):
        with pytest.raises(rr.InvalidInputError, match="grouped_allreduce_"):
            c.grouped_allreduce_async_([np.ones(3), np.ones(4)[::2]], op=rr.Sum, name="nc")
        with pytest.raises(rr.InvalidInputError, match="grouped_allreduce"):
            c.grouped_allreduce_async_([], op=rr.Sum, name="empty")
        with pytest.raises(rr.InvalidInputError):
            c.grouped_allreduce_async_([np.ones(3)], op=12345, name="op")
        ro = np.ones(3)
        ro.flags.writeable = False
        with pytest.raises(rr.InvalidInputError, match="grouped_allreduce_"):
            c.grouped_allreduce_async_([ro], op=rr.Sum, name="ro")
        return True

    assert run_threaded(2, body) == [True, True]


@pytest.mark.parametrize("in_place", [False, True])
def test_grouped_calls_of_different_lengths_fail_on_every_rank(in_place):
    """Rank 1 groups one tensor more than rank 0 under one name: both ranks raise
    MismatchError naming the groups (the extra member is failed too), and the name works
    again afterwards."""

    def body(c):
        xs = [np.ones(3, np.float32) for _ in range(3 + c.rank())]
        with pytest.raises(rr.MismatchError, match="group='g#3'.*group='g#4'"):
            if in_place:  # the C++ path of grouped_allreduce_arrays
                c.grouped_allreduce_async_(xs, op=rr.Sum, name="g").wait()
            else:
                c.grouped_allreduce(xs, op=rr.Sum, name="g")
        again = c.grouped_allreduce([np.ones(2, np.float32)] * 2, op=rr.Sum, name="g")
        return [a.tolist() for a in again]

    assert run_threaded(2, body, timeout=30) == [[[2.0, 2.0]] * 2] * 2


def test_duplicate_name_in_flight_is_refused_until_synchronized():
    # Rank 1 submits only once rank 0 has checked: until then 'dup' cannot complete
    # (were rank 1 first, rank 0's call could finish before its second submit).
    checked = threading.Event()

    def body(c):
        x = np.ones(10, np.float32)
        if c.rank() == 1:
            assert checked.wait(60)
        h = c.allreduce_async(x, name="dup")
        if c.rank() == 0:
            try:
                with pytest.raises(rr.InvalidInputError, match="'dup': a tensor of this name "
                                                               "is already in flight"):
                    c.allreduce_async(x, name="dup")
            finally:
                checked.set()
        h.wait()
        return c.allreduce(x, name="dup", op=rr.Sum)  # free again once synchronized

    assert all((o == 2).all() for o in run_threaded(2, body))


def test_keep_alive_bookkeeping_is_safe_across_threads():
    """Threads submitting while others release finished handles (rr.synchronize, blocking
    calls do): a submit must never fail because another thread emptied the queue."""
    import sys

    (c,) = make_world(1)
    errors, stop = [], threading.Event()

    def submitter(k):
        x = np.ones(4, np.float32)
        try:
            for _ in range(8000):
                h = c.allreduce_async_(x, name=f"t{k}")
                while not h.done():
                    pass
        except Exception as err:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(err))

    def releaser():
        while not stop.is_set():
            c.release_done()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as possible
    submitters = [threading.Thread(target=submitter, args=(k,)) for k in range(2)]
    releasers = [threading.Thread(target=releaser) for _ in range(2)]
    try:
        for t in submitters + releasers:
            t.start()
        for t in submitters:
            t.join(60)
    finally:
        stop.set()
        for t in releasers:
            t.join(10)
        sys.setswitchinterval(old)
        c.close()
    assert errors == []


def test_stall_warning_names_tensor_and_missing_rank(capfd):
    w = world(2, RINGREDUCE_STALL_CHECK_SECONDS="0.3")

    def body(c):
        if c.rank() == 1:
            time.sleep(1.0)  # rank 1 is late, then catches up
        return c.allreduce(np.ones(3), op=rr.Sum, name="slowpoke")

    out = run_threaded(2, body, world=w)
    assert all((o == 2).all() for o in out)
    err = capfd.readouterr().err
    assert "stalled tensors" in err and "'slowpoke'" in err
    assert "submitted by rank 0, missing on rank 1" in err
    assert "[ringreduce WARNING rank 1]" in err  # every rank logs it
    for c in w:
        c.close()


def test_stall_shutdown_raises_on_every_rank():
    w = world(2, RINGREDUCE_STALL_CHECK_SECONDS="0.2", RINGREDUCE_STALL_SHUTDOWN_SECONDS="0.8")

    def body(c):
        t0 = time.monotonic()
        try:
            c.allreduce(np.ones(3), name=f"grad{c.rank()}")  # different names: never ready
        except rr.RingReduceTimeoutError as e:
            return time.monotonic() - t0, str(e)
        return None

    res = run_threaded(2, body, world=w, timeout=30)
    for took, msg in res:
        assert took < 5
        # the first rank's tensor hits the limit first; the other may not be listed yet
        assert ("'grad0'" in msg or "'grad1'" in msg) and "missing on rank" in msg
        assert "RINGREDUCE_STALL_SHUTDOWN_SECONDS" in msg
    with pytest.raises(rr.RingReduceError, match="stopped after an earlier failure"):
        w[0].allreduce(np.ones(1))
    for c in w:
        c.close()


@pytest.mark.parametrize("capacity", ["0", "3"])
def test_small_or_disabled_cache_stays_correct_over_steps(capacity):
    w = world(2, RINGREDUCE_CACHE_CAPACITY=capacity)

    def body(c):
        out = []
        for step in range(4):
            gs = grads(c.rank(), count=8, seed=step)
            order = list(range(8))[::-1] if (step + c.rank()) % 2 else list(range(8))
            hs = {i: c.allreduce_async(gs[i], op=rr.Sum, name=f"g{i}") for i in order}
            out.append([hs[i].wait() for i in range(8)])
        return out

    res = run_threaded(2, body, world=w)
    for step in range(4):
        for i in range(8):
            want = grads(0, 8, step)[i] + grads(1, 8, step)[i]
            for r in range(2):
                np.testing.assert_array_equal(res[r][step][i], want)
    for c in w:
        c.close()


def test_timeline_is_valid_json_with_every_phase(tmp_path):
    path = tmp_path / "timeline.json"
    w = world(2, RINGREDUCE_TIMELINE=str(path), RINGREDUCE_SMALL_BYTES="1024",
              RINGREDUCE_SHARED_MIN_BYTES="0")

    def body(c):
        c.grouped_allreduce_async([np.ones(3), np.ones(5)], name="tiny").wait()  # packed
        c.allreduce_(c.shared_zeros(1000), name="shared")
        hs = [c.allreduce_async(x, name=f"t{i}") for i, x in enumerate(grads(c.rank()))]
        [h.wait() for h in hs]
        c.broadcast(np.ones(100000), root_rank=0, name="b")
        c.allreduce(np.ones(4), name="small")  # folded (engine_fold.cc)

    run_threaded(2, body, world=w)
    for c in w:
        c.close()
    events = json.loads(path.read_text())
    names = {e["name"] for e in events}
    for phase in ["NEGOTIATE_ALLREDUCE", "rank 0 ready", "rank 1 ready", "WAIT", "allreduce",
                  "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER", "AGREE", "DIRECT",
                  "RING_REDUCE_SCATTER", "RING_ALLGATHER", "NEGOTIATE_BROADCAST",
                  "BROADCAST_CHAIN", "SHARED_REDUCE", "allreduce (folded)"]:
        assert phase in names, phase
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"t0", "t11", "b", "small"} <= rows
    begins = sum(e["ph"] == "B" for e in events)
    assert begins == sum(e["ph"] == "E" for e in events) and begins > 40


def test_dropped_handle_keeps_buffers_alive():
    def body(c):
        for i in range(20):
            c.allreduce_async(np.ones(50000, np.float32), name=f"fire{i}")  # never waited
        return c.allreduce(np.ones(2), op=rr.Sum, name="last")

    assert all((o == 2).all() for o in run_threaded(2, body))


def test_in_place_hot_path_handle_keeps_its_array_and_returns_it():
    """allreduce_async_ of a plain numpy array gets a C++ handle: dropped, it still keeps the
    array alive; waited on (twice), it returns the array itself; poll() works on it."""

    def body(c):
        for i in range(20):
            c.allreduce_async_(np.ones(50000, np.float32), op=rr.Sum, name=f"fire{i}")
        gc.collect()
        x = np.ones(70000, np.float32)
        h = c.allreduce_async_(x, op=rr.Sum, name="kept")
        assert isinstance(h, _core.ArrayHandle)
        out = rr.synchronize(h)
        assert out is x and h.wait() is x and rr.poll(h)
        return x

    assert all((o == 2).all() for o in run_threaded(2, body))


def test_tcp_engine_between_fake_hosts():
    with env(RINGREDUCE_TRANSPORT="tcp"):
        w = make_world(3, host_ids=["a", "b", "c"])

    def body(c):
        hs = [c.allreduce_async(x, op=rr.Sum, name=f"g{i}") for i, x in enumerate(grads(c.rank()))]
        return [h.wait() for h in hs]

    res = run_threaded(3, body, world=w)
    for i in range(len(grads(0))):
        np.testing.assert_array_equal(res[2][i], sum(grads(r)[i] for r in range(3)))
    for c in w:
        c.close()


@pytest.mark.parametrize("settings", [
    {}, {"RINGREDUCE_SHM_SLOT_BYTES": "4096"}, {"RINGREDUCE_TRANSPORT": "tcp"},
    {"RINGREDUCE_SHM_SLOT_BYTES": "4096", "RINGREDUCE_RING_SLICE_BYTES": "12288"},
    {"RINGREDUCE_TRANSPORT": "tcp", "RINGREDUCE_SHM_SLOT_BYTES": "4096",
     "RINGREDUCE_RING_SLICE_BYTES": "8192"}])
def test_fused_in_place_ring_matches_reference(settings):
    """Fused responses above the small size run one ring over the tensors in place;
    chunks that span tensors are gathered (small slots make that common)."""
    w = world(3, **settings)

    def body(c):
        hs = [c.allreduce_async(x, op=rr.Average, name=f"g{i}", postscale_factor=3.0)
              for i, x in enumerate(grads(c.rank()))]
        return [h.wait() for h in hs]

    res = run_threaded(3, body, world=w)
    for i in range(len(grads(0))):
        want = sum(grads(r)[i].astype(np.float64) for r in range(3)) / 3 * 3.0
        for r in range(3):
            np.testing.assert_allclose(res[r][i], want, rtol=1e-6)
        np.testing.assert_array_equal(res[0][i], res[2][i])
    for c in w:
        c.close()


@pytest.mark.parametrize("var,values", [("RINGREDUCE_CACHE_CAPACITY", ("1024", "2")),
                                        ("RINGREDUCE_RING_SLICE_BYTES", ("1048576", "524288"))])
def test_settings_that_must_match_are_checked(var, values):
    # each rank reads its own environment
    comms = make_world(2, ["h", "h"], rank_env=[{var: value} for value in values])
    errs = run_threaded(2, lambda c: c.allreduce(np.ones(2)), world=comms,
                        return_exceptions=True)
    for e in errs:
        assert isinstance(e, rr.MismatchError), e
        key = var.removeprefix("RINGREDUCE_")
        assert f"{key}={values[0]}" in str(e) and f"{key}={values[1]}" in str(e)
    for c in comms:
        c.close()


def test_concurrent_close_while_busy_is_safe():
    w = world(2)
    hs = [c.allreduce_async(np.ones(1 << 22, np.float32), name="big") for c in w]
    closers = [threading.Thread(target=c.close) for c in w for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
    assert not any(t.is_alive() for t in closers)
    for h in hs:
        try:
            h.wait()
        except rr.RingReduceError:
            pass  # shut down or peer gone: either is fine, a crash is not


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_streaming_send_modes_give_identical_results(mode):
    w = world(2, RINGREDUCE_SHM_STREAM_SEND=mode, RINGREDUCE_SHM_STREAM_SEND_BYTES="65536")

    def body(c):
        x = np.arange(600000, dtype=np.float32) * (c.rank() + 1)
        return [c.allreduce(x, op=rr.Sum, name=f"s{i}") for i in range(12)]  # auto explores

    for outs in run_threaded(2, body, world=w):
        for o in outs:
            np.testing.assert_array_equal(o, np.arange(600000, dtype=np.float32) * 3)
    for c in w:
        c.close()


def test_bad_streaming_mode_is_refused():
    with env(RINGREDUCE_SHM_STREAM_SEND="sometimes"):
        with pytest.raises(rr.InvalidInputError, match="RINGREDUCE_SHM_STREAM_SEND='sometimes'"):
            make_world(2)


def test_transport_table_choice_and_filter():
    """Each peer gets the first entry of the transport table that reaches it (shm on one
    host, TCP across); RINGREDUCE_TRANSPORT filters the table: tcp everywhere, shm alone
    reaches no other host (an error naming the rank and its host, before any connection),
    and a name not in the table lists those that are."""
    with env(RINGREDUCE_TRANSPORT="tcp"):
        w = make_world(3, ["a", "a", "b"])
    try:
        assert [w[0].transport_to(p) for p in (1, 2)] == ["tcp", "tcp"]
    finally:
        for c in w:
            c.close()
    with env(RINGREDUCE_TRANSPORT="shm"):
        with pytest.raises(rr.InvalidInputError, match="RINGREDUCE_TRANSPORT=shm but no "
                           r"transport it allows reaches rank \d on another host \((a|b)\)"):
            make_world(3, ["a", "a", "b"])
    with env(RINGREDUCE_TRANSPORT="ib"):
        with pytest.raises(rr.InvalidInputError, match="'ib' is not one of auto, shm, tcp"):
            make_world(2)


def test_two_host_coordinator_wakes_for_a_late_shm_worker():
    """Rank 0 of a two-host job sleeps in poll() (its worker on the other host is a TCP
    peer); a late request from its shm worker must wake it through the doorbell watcher
    (coordination/doorbell_watcher.h), not after poll()'s 100 ms liveness timeout."""
    w = make_world(3, ["a", "a", "b"])
    assert w[0].transport_to(1) == "shm" and w[0].transport_to(2) == "tcp"

    def body(c):
        late = []
        for i, pause in enumerate((0.25, 0.22, 0.35, 0.24, 0.36)):
            if c.rank() == 1:
                time.sleep(pause)  # the others wait; rank 0's engine goes to sleep
            t0 = time.perf_counter()
            c.allreduce(np.ones(4), name=f"late{i}")
            late.append(time.perf_counter() - t0)
        return late

    try:
        res = run_threaded(3, body, world=w)
        assert max(res[1]) < 0.03, f"rank 1's late allreduces took {res[1]} s"
    finally:
        for c in w:
            c.close()


@pytest.mark.parametrize("fast", ["1", "0"], ids=["caller-driven", "engine-driven"])
def test_blocking_calls_drive_their_own_rounds(fast):
    """A blocking call on an idle engine runs its round on the caller's thread
    (coordination/engine_drive.cc; counted in ``caller_rounds``), and
    RINGREDUCE_FAST_PATH=0 leaves every round to the engine thread. On either path:
    results, submission orders that differ between ranks, a mismatch and a call refused
    on one rank raising on both and naming the rank, and join with uneven steps."""
    w = world(2, RINGREDUCE_FAST_PATH=fast)

    def body(c):
        r = c.rank()
        before = c._engine.stats()["caller_rounds"]
        for i in range(40):
            got = c.allreduce(np.full(3, r + i, np.float32), op=rr.Sum, name="loop")
            np.testing.assert_array_equal(got, np.full(3, 2 * i + 1, np.float32))
            c.barrier()
        names = ["a", "b"] if r == 0 else ["b", "a"]
        hs = {n: c.allreduce_async(np.full(2, r + 1, np.float32), op=rr.Sum, name=n)
              for n in names}
        assert all((rr.synchronize(hs[n]) == 3).all() for n in reversed(names))
        errors = []
        for call in (lambda: c.allreduce(np.ones(3 + r, np.float32), name="mm"),
                     lambda: c.broadcast(np.ones(2), root_rank=5 if r else 0, name="bc")):
            with pytest.raises(rr.RingReduceError) as err:
                call()
            errors.append(err.value)
        extra = [c.allreduce(np.ones(2, np.float32), op=rr.Sum, name="extra")
                 for _ in range(2 if r == 0 else 0)]
        last = c.join()
        return c._engine.stats()["caller_rounds"] - before, errors, extra, last

    res = run_threaded(2, body, world=w, timeout=60)
    driven = [d for d, *_ in res]
    assert all(d > 0 for d in driven) if fast == "1" else driven == [0, 0], driven
    for r, (_, (mm, refused), extra, last) in enumerate(res):
        assert isinstance(mm, rr.MismatchError), mm
        assert "rank 0 called allreduce float32[3]" in str(mm), mm
        assert "rank 1 called allreduce float32[4]" in str(mm), mm
        if r == 0:
            assert isinstance(refused, rr.MismatchError), refused
            assert "rank 1 refused this call locally" in str(refused), refused
        else:
            assert isinstance(refused, rr.InvalidInputError), refused
        assert [e.tolist() for e in extra] == ([[1, 1]] * 2 if r == 0 else []), extra
        assert last == 0, last


def test_a_name_refused_on_one_rank_can_be_used_again_at_once():
    """Rank 1 refuses a named call (a bad root) and goes straight on to the name's next
    calls while rank 0 has not yet made the refused one: rank 0's call raises, naming
    rank 1; every later call of the name runs on both (rank 1's early calls wait for
    the refused one to be decided instead of being dropped). Then both ranks refuse
    the same call and use the name again. Last, calls of a name in flight on rank 0 (a
    duplicate, and a broadcast with a bad root) are refused there alone and the call in
    flight goes on, every time (the bad root was once sent to rank 0 and failed the call
    in flight, or, when that call finished first in a paired round, the name's next call
    on rank 1). Rank 1 submits only once rank 0 has checked: were rank 1 first, rank 0's
    call could finish before its second one, which would then be a real call that rank 1
    never makes (a stall, not a refusal)."""
    w = world(2)
    checked = [threading.Event() for _ in range(4)]

    def body(c):
        r, got, errors = c.rank(), [], []
        if r == 1:
            with pytest.raises(rr.InvalidInputError):
                c.broadcast(np.ones(2), root_rank=5, name="x")
        else:
            time.sleep(0.2)  # rank 1's next calls of "x" reach rank 0 first
            with pytest.raises(rr.MismatchError, match="rank 1 refused this call locally"):
                c.broadcast(np.ones(2), root_rank=0, name="x")
        for i in range(3):
            got.append(c.broadcast(np.full(2, r + i, np.float32), root_rank=1, name="x"))
        with pytest.raises(rr.InvalidInputError):
            c.broadcast(np.ones(2), root_rank=7, name="y")  # refused on both
        got.append(c.broadcast(np.full(2, r + 5.0), root_rank=0, name="y"))
        for i, done in enumerate(checked):
            if r == 1:
                assert done.wait(60)
            h = c.allreduce_async(np.full(3, i + 1.0), op=rr.Sum, name="z")
            if r == 0:
                try:
                    for again in (lambda: c.allreduce(np.ones(3), op=rr.Sum, name="z"),
                                  lambda: c.broadcast(np.ones(3), root_rank=5, name="z")):
                        with pytest.raises(rr.InvalidInputError) as err:
                            again()
                        errors.append(err.value)
                finally:
                    done.set()
            got.append(h.wait())
        return got, errors

    results = run_threaded(2, body, world=w, timeout=60)
    for got, _ in results:
        assert [g.tolist() for g in got] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [5.0, 5.0]] + [
            [2.0 * i] * 3 for i in range(1, 5)], got
    assert [str(e).split("'z': ")[1][:14] for e in results[0][1]] == [
        "a tensor of th", "root_rank must"] * 4, results[0][1]
    assert results[1][1] == [], results[1][1]


def engine_thread_count() -> int:
    """Threads of this process named ``rr-engine`` (/proc/self/task/*/comm)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "rr-engine"
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_engine_threads_are_named_for_per_thread_cpu_accounting():
    # benchmarks/train_scaling.py tells the engine's CPU time from torch's by this name.
    # (Engines of earlier tests may still be ending: only a lower bound is certain.)
    w = make_world(2)
    try:
        assert engine_thread_count() >= 2
    finally:
        for c in w:
            c.close()
