"""The engine's wake-ups for GPU work, without a GPU (FakeGpuOps, whose
event_synchronize returns when a test completes the event): a completion wakes the
engine at once through the executor's watcher thread (csrc/gpu/completion_watcher.h),
a late or failed wake-up neither spins the engine nor loses work, and the opt-in hold of
GPU work while the device is behind (RINGREDUCE_GPU_QUEUE_DEPTH) fuses what it holds,
never holds a waiting caller and never holds rank 0's stall checks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gpu_fakes import fake_gpu, tensor, wait_done
from ringreduce._core.gpu import testing as gt
from workers.workerlib import engine_cpu_seconds

import ringreduce as rr
from ringreduce.testing import make_world


@pytest.fixture
def comm():
    (c,) = make_world(1)
    yield c
    c.close()


@pytest.mark.timeout(60)
def test_finished_gpu_work_wakes_the_engine_at_once(comm):
    # A watcher thread sleeps on each response's completion event and wakes the
    # engine when it fires: with polls 30 s apart, the handle still completes as
    # soon as the event does.
    ops = fake_gpu(comm._engine, 30.0)
    for i in range(3):
        h = gt.submit(comm._engine, tensor(f"w{i}", 8), 0)
        _wait_for(lambda n=i: _reduced(ops) == n + 1, "not enqueued")
        _wait_for(lambda n=i: ops.syncs() == n + 1, "the watcher does not wait on the event")
        time.sleep(0.1)  # the engine thread is asleep by now
        assert not h.done()
        ops.complete_all()
        wait_done(h, timeout=10)  # without the wake-up: 30 s
        h.wait()


def _reduced(ops):
    """How many NCCL allreduces the executor has enqueued."""
    return sum(c.startswith("nccl_allreduce") for c in ops.calls())


def _wait_for(pred, what, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.001)


def _enqueue_one_by_one(engine, ops, names):
    handles = []
    for n in names:
        seen = _reduced(ops)
        handles.append(gt.submit(engine, tensor(n, 8), 0))
        _wait_for(lambda s=seen: _reduced(ops) == s + 1, f"{n} was not enqueued")
    return handles


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [2, 0])
def test_gpu_work_waits_while_the_device_is_behind_then_goes_out_fused(depth):
    # Two responses in flight on the GPU: what is submitted meanwhile (here two
    # tensors 30 ms apart, far beyond the batching window) is held back and goes
    # out as one fused response once the device finishes one.
    # RINGREDUCE_GPU_QUEUE_DEPTH=0 (the default) turns the hold off.
    (c,) = make_world(1, rank_env=[{"RINGREDUCE_GPU_QUEUE_DEPTH": str(depth)}])
    try:
        ops = fake_gpu(c._engine)
        first = _enqueue_one_by_one(c._engine, ops, ["a0", "a1"])
        later = [gt.submit(c._engine, tensor("b0", 8), 0)]
        time.sleep(0.03)
        later.append(gt.submit(c._engine, tensor("b1", 8), 0))
        time.sleep(0.05)
        if depth:
            assert _reduced(ops) == 2, ops.calls()
            assert c._engine.stats()["device_holds"] > 0
        else:
            _wait_for(lambda: _reduced(ops) == 4, "without the hold each goes out alone")
        ops.complete_all(sticky=True)
        for h in first + later:
            wait_done(h)
            h.wait()
        counts = [int(x.split()[3]) for x in ops.calls() if x.startswith("nccl_allreduce")]
        if depth:  # one fused reduction (each tensor's slot aligned in the fusion buffer)
            assert len(counts) == 3 and counts[2] >= 16, ops.calls()
            assert any(x.startswith("launch_pack 2 descs") for x in ops.calls()), ops.calls()
        else:
            assert counts == [8, 8, 8, 8], ops.calls()
    finally:
        c.close()


@pytest.mark.timeout(60)
def test_a_caller_that_waits_is_never_held_behind_a_busy_device():
    (comm,) = make_world(1, rank_env=[{"RINGREDUCE_GPU_QUEUE_DEPTH": "2"}])
    ops = fake_gpu(comm._engine)
    busy = _enqueue_one_by_one(comm._engine, ops, ["c0", "c1"])
    h = gt.submit(comm._engine, tensor("d", 8), 0)
    time.sleep(0.05)
    assert _reduced(ops) == 2  # held
    waiter = threading.Thread(target=h.wait)
    waiter.start()  # a blocking call: the caller waits at once
    _wait_for(lambda: _reduced(ops) == 3, "a waiting caller was held")
    ops.complete_all(sticky=True)
    waiter.join(10)
    assert not waiter.is_alive()
    for b in busy:
        wait_done(b)
    comm.close()


@pytest.mark.timeout(60)
def test_a_wake_up_after_the_work_was_polled_complete_leaves_the_engine_asleep(comm):
    # The watcher's thread wakes some microseconds after the event completes, so
    # the engine's own poll often sees the work done first: the late ring then
    # arrives with nothing in flight and must not keep the thread awake.
    ops = fake_gpu(comm._engine, 0.001)
    ops.defer_rings(True)
    h = gt.submit(comm._engine, tensor("late", 8), 0)
    _wait_for(lambda: _reduced(ops) == 1 and ops.syncs() == 1, "late was not watched")
    ops.complete_all()
    wait_done(h)  # found by polling; the ring is still to come
    ops.ring_late()
    time.sleep(0.05)
    before = engine_cpu_seconds()
    time.sleep(0.5)
    assert engine_cpu_seconds() - before < 0.1, "the engine thread spins after a late wake-up"


@pytest.mark.timeout(60)
def test_a_response_finished_while_the_watcher_lags_still_wakes_the_engine(comm):
    # The watcher may lag behind the engine's polls (a blocking-sync wait returns late,
    # its thread waits for a core): here it is held in its wait for z while a round polls
    # z and a complete and enqueues c. Were a's done-event, still queued for the watcher,
    # reused for c, the watcher would wait on it for c, past b: b finishing would wake no
    # one until c did (or the next poll, here 30 s away).
    ops = fake_gpu(comm._engine, 30.0)
    ops.defer_rings(True)  # the watcher's first wait (z's) returns only when told
    hz, ha, hb = _enqueue_one_by_one(comm._engine, ops, ["z", "a", "b"])
    _wait_for(lambda: ops.syncs() == 1, "z was not watched")
    recorded = [c.split()[1] for c in ops.calls() if c.startswith("event_record")]
    done_b = recorded[-1]  # b's completion event, the last recorded
    for ev in set(recorded) - {done_b}:
        ops.set_event(int(ev.split("#")[1]), "done")
    hc = gt.submit(comm._engine, tensor("c", 8), 0)  # its round polls z and a complete
    _wait_for(lambda: _reduced(ops) == 4, "c was not enqueued")
    wait_done(hz)
    wait_done(ha)
    ops.defer_rings(False)  # the watcher catches up: z, then a
    time.sleep(0.05)
    ops.set_event(int(done_b.split("#")[1]), "done")
    try:
        wait_done(hb, timeout=5)  # woken at once; without a wake-up: 30 s
        assert not hc.done()
    finally:
        ops.complete_all(sticky=True)
    wait_done(hc)


@pytest.mark.timeout(60)
def test_a_failed_completion_wait_leaves_the_enqueued_work_to_polling(comm):
    # The watcher's wait fails after the response's work is on the stream: that
    # must neither fail the engine (the NCCL call is already issued, on every
    # rank) nor drop the response from those in flight; its early ring is spurious.
    ops = fake_gpu(comm._engine, 0.001)
    ops.fail_next("event_synchronize", "cudaEventSynchronize failed: cudaErrorNotPermitted")
    h = gt.submit(comm._engine, tensor("nowake", 8), 0)
    _wait_for(lambda: any(c.startswith("nccl_allreduce") for c in ops.calls()), "not enqueued")
    time.sleep(0.05)
    assert not h.done()
    ops.complete_all()
    wait_done(h)
    h.wait()
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(comm.allreduce(x, op=rr.Sum, name="after"), x)


@pytest.mark.timeout(60)
def test_held_gpu_work_does_not_hold_rank_0s_stall_checks():
    # Rank 0's device is stuck behind two responses (a peer that never runs its
    # NCCL calls, say) and its new GPU work is held. A tensor that rank 1 alone
    # submitted must still be reported (here: stall shutdown after 1 s) instead
    # of waiting for the device.
    env = {"RINGREDUCE_GPU_QUEUE_DEPTH": "2", "RINGREDUCE_STALL_SHUTDOWN_SECONDS": "1"}
    c0, c1 = make_world(2, rank_env=[env, env])
    try:
        ops = [gt.FakeGpuOps(), gt.FakeGpuOps()]
        for c, o in zip((c0, c1), ops):
            gt.use_fake_gpus(c._engine, {0: o})
        for n in ("s0", "s1"):
            for c in (c0, c1):
                gt.submit(c._engine, tensor(n, 8), 0)
            _wait_for(lambda s=n: all(_reduced(o) == int(s[1]) + 1 for o in ops), f"{n}")
        lonely = c1.allreduce_async(np.ones(3, np.float32), op=rr.Sum, name="lonely")
        time.sleep(0.2)  # rank 0 has taken lonely in; now its own new GPU work is held
        gt.submit(c0._engine, tensor("held", 8), 0)
        t0 = time.monotonic()
        with pytest.raises(rr.RingReduceTimeoutError):
            lonely.wait()
        assert time.monotonic() - t0 < 10
    finally:
        for o in ops:
            o.complete_all(sticky=True)
        c0.close()
        c1.close()
