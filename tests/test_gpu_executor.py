"""The GPU executor's planning, without a GPU: csrc/gpu/gpu_executor.cc driven over
FakeGpuOps (csrc/gpu/fake_gpu_ops.cc), which logs every CUDA / NCCL call in order and is
told when events finish or NCCL fails. Also the engine's side: executors chosen by
device, completion only when poll() reports it, no fusion across devices, and a clear
error when no GPU executor can be made."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_fakes import (
    AVG,
    BF16,
    F16,
    FUSION,
    I32,
    NCCL_2_9,
    NCCL_2_27,
    SUM,
    call,
    executor,
    fake_gpu_world,
    tensor,
    verbs,
    wait_done,
)
from ringreduce._core import coordination as co
from ringreduce._core.gpu import testing as gt

import ringreduce as rr
from ringreduce import _core
from ringreduce.testing import make_world, run_threaded


# ------------------------------------------------------------- executor alone
def test_fused_allreduce_of_three_tensors_is_one_pack_one_reduce_one_unpack():
    ops, ex = executor()
    ts = [tensor(f"t{i}", n, i, stream=7, prescale=0.5, postscale=3.0)
          for i, n in enumerate([10, 1000, 3])]
    assert ex.execute([{**t, "op": SUM} for t in ts]) is False  # enqueued, not done
    assert verbs(ops) == [
        "event_create", "event_record", "stream_wait_event",  # wait for the producer stream
        "malloc_device",  # the fusion buffer, once
        "launch_pack", "launch_scale", "nccl_allreduce", "launch_scale", "launch_unpack",
        "event_create", "event_record",  # the completion event, on the library stream
    ]
    calls = ops.calls()
    assert calls[1] == "event_record event#1 stream#7"
    assert calls[2] == "stream_wait_event stream#1 event#1"
    # 256-byte aligned layout: offsets 0, 256, 256 + 4000 rounded up = 4352; 4364 bytes
    pack = call(ops, "launch_pack")
    assert pack[1] == "3" and pack[5:] == [
        f"0x7000000->{FUSION:#x}:40", f"0x7100000->{FUSION + 256:#x}:4000",
        f"0x7200000->{FUSION + 4352:#x}:12"]
    unpack = call(ops, "launch_unpack")
    assert unpack[5:] == [
        f"{FUSION:#x}->0x8000000:40", f"{FUSION + 256:#x}->0x8100000:4000",
        f"{FUSION + 4352:#x}->0x8200000:12"]
    assert calls[5] == f"launch_scale {FUSION:#x} 1091 float32 0.5 stream#1"
    assert calls[6] == f"nccl_allreduce {FUSION:#x} {FUSION:#x} 1091 float32 sum stream#1"
    assert calls[7] == f"launch_scale {FUSION:#x} 1091 float32 3 stream#1"
    assert calls[-1] == "event_record event#2 stream#1"


def test_chunked_descriptors_still_one_launch_each():
    ops, ex = executor(chunk_bytes=1024)
    ex.execute([tensor("a", 1000, 0), tensor("b", 10, 1)])
    assert verbs(ops).count("launch_pack") == 1 and verbs(ops).count("launch_unpack") == 1
    assert call(ops, "launch_pack")[1] == "5"  # 4000 bytes in 4 chunks of <= 1024, plus one


def test_fusion_buffer_is_reused_and_grows_behind_the_stream():
    ops, ex = executor()
    ex.execute([tensor("a", 10, 0), tensor("b", 10, 1)])
    ex.execute([tensor("c", 10, 0), tensor("d", 10, 1)])
    assert verbs(ops).count("malloc_device") == 1
    ex.execute([tensor("e", 100000, 0), tensor("f", 10, 1)])
    assert verbs(ops).count("malloc_device") == 2
    assert f"free_device {FUSION:#x} stream#1" in ops.calls()


def test_single_tensor_runs_in_place_without_pack():
    ops, ex = executor()
    ex.execute([tensor("x", 100, out=0x7000000)])  # in == out
    assert verbs(ops) == ["event_create", "event_record", "stream_wait_event",
                          "nccl_allreduce", "event_create", "event_record"]
    assert call(ops, "nccl_allreduce")[1:4] == ["0x7000000", "0x7000000", "100"]


def test_single_tensor_out_of_place_reduces_straight_into_the_output():
    ops, ex = executor()
    ex.execute([tensor("x", 100)])
    assert call(ops, "nccl_allreduce")[1:3] == ["0x7000000", "0x8000000"]
    assert "memcpy_async" not in verbs(ops)


def test_single_tensor_prescale_never_touches_the_input():
    ops, ex = executor()
    ex.execute([tensor("x", 100, prescale=2.0)])
    assert verbs(ops)[3:6] == ["memcpy_async", "launch_scale", "nccl_allreduce"]
    assert call(ops, "memcpy_async")[1:4] == ["0x8000000", "0x7000000", "400"]
    assert call(ops, "launch_scale")[1] == "0x8000000"
    assert call(ops, "nccl_allreduce")[1:3] == ["0x8000000", "0x8000000"]


@pytest.mark.parametrize("version, size, post, op, scales", [
    (NCCL_2_27, 2, 1.0, "avg", []),        # ncclAvg, nothing to scale after
    (NCCL_2_27, 2, 3.0, "avg", ["3"]),     # ncclAvg, then the postscale
    (NCCL_2_9, 2, 1.0, "sum", ["0.5"]),    # no ncclAvg: Sum, then 1 / size
    (NCCL_2_9, 4, 3.0, "sum", ["0.75"]),   # 1 / size folded into the postscale
])
def test_average_with_and_without_nccl_avg(version, size, post, op, scales):
    ops, ex = executor(version, size=size)
    ex.execute([tensor("x", 8, op=AVG, postscale=post)])
    assert call(ops, "nccl_allreduce")[5] == op
    assert [c.split()[4] for c in ops.calls() if c.startswith("launch_scale")] == scales


def test_average_of_integers_and_with_joined_ranks_runs_as_sum():
    ops, ex = executor(NCCL_2_27, size=4)
    ex.execute([tensor("i", 8, op=AVG, dtype=I32)])
    assert call(ops, "nccl_allreduce")[4:6] == ["int32", "sum"]
    assert call(ops, "launch_scale")[2:5] == ["8", "int32", "0.25"]
    ops.clear_calls()
    ex.execute([tensor("j", 8, op=AVG)], contributors=2)  # two ranks joined
    assert call(ops, "nccl_allreduce")[5] == "sum"
    assert call(ops, "launch_scale")[4] == "0.5"  # divided by the contributors


def test_no_scale_launches_at_one():
    ops, ex = executor()
    ex.execute([tensor("a", 8, 0), tensor("b", 8, 1)])
    assert "launch_scale" not in verbs(ops)


def test_producer_waits_one_per_event_or_stream():
    ops, ex = executor()
    ex.execute([tensor("a", 8, 0, event=900), tensor("b", 8, 1, event=900),
                tensor("c", 8, 2, event=901), tensor("d", 8, 3, stream=5),
                tensor("e", 8, 4, stream=5), tensor("f", 8, 5)])
    waits = [c for c in ops.calls() if c.startswith(("stream_wait_event", "event_record"))]
    assert waits[:5] == [
        "stream_wait_event stream#1 event#900", "stream_wait_event stream#1 event#901",
        "event_record event#1 stream#5", "stream_wait_event stream#1 event#1",
        "event_record event#2 stream#default"]


def test_poll_reports_nothing_until_the_event_is_done_and_keeps_order():
    ops, ex = executor()
    ex.execute([tensor("a", 8)])   # completion event#2 (event#1: the producer wait)
    ex.execute([tensor("b", 8)])   # event#3 for the producer, event#4 completes
    assert ex.poll() == [] and ex.busy
    ops.set_event(4, "done")       # the later one alone cannot complete first
    assert ex.poll() == []
    ops.set_event(2, "done")
    assert [c["names"] for c in ex.poll()] == [["a"], ["b"]]
    assert not ex.busy and ex.poll() == []


def test_events_are_reused_after_completion():
    ops, ex = executor()
    ex.execute([tensor("a", 8)])
    ops.complete_all()
    ex.poll()
    ops.clear_calls()
    ex.execute([tensor("b", 8)])
    assert "event_create" not in verbs(ops)


def test_nccl_async_error_fails_the_entries_with_nccls_message():
    ops, ex = executor()
    ex.execute([tensor("a", 8, 0), tensor("b", 8, 1)])
    ex.execute([tensor("c", 8)])
    ops.set_async_error("unhandled system error (2)")
    out = ex.poll()
    assert [c["names"] for c in out] == [["a", "b"], ["c"]]
    assert all(not c["ok"] and "unhandled system error (2)" in c["message"] for c in out)
    assert "NCCL failed on GPU 0" in out[0]["message"]
    assert verbs(ops)[-1] == "nccl_abort"
    # the communicator is gone: later work fails the same way, nothing is enqueued
    ops.clear_calls()
    assert ex.execute([tensor("d", 8)]) is False and ops.calls() == []
    (late,) = ex.poll()
    assert late["names"] == ["d"] and "unhandled system error" in late["message"]


def test_work_finished_before_a_peer_left_completes_despite_nccls_error():
    # A peer that exits right after its last collective: NCCL reports the error, but
    # work whose event already fired is done; only what still waits for the peer fails.
    ops, ex = executor()
    ex.execute([tensor("done", 8)])
    ops.complete_all()
    ex.execute([tensor("waits", 8)])
    ops.set_async_error("remote process exited or there was a network error (6)")
    out = ex.poll()
    assert [(c["names"], c["ok"]) for c in out] == [(["done"], True), (["waits"], False)]
    assert "remote process exited" in out[1]["message"]


def test_cuda_error_on_the_event_fails_the_entries():
    ops, ex = executor()
    ex.execute([tensor("a", 8)])
    ops.set_event(2, "error", "cudaErrorIllegalAddress: an illegal memory access")
    (c,) = ex.poll()
    assert not c["ok"] and "illegal memory access" in c["message"]


def test_joined_rank_zero_fills_the_tensors_it_lacks():
    ops, ex = executor()
    ex.execute([tensor("a", 10, 0), {**tensor("b", 64, 1), "in": None}, tensor("c", 3, 2)],
               contributors=1)
    assert call(ops, "launch_pack")[1] == "2"
    assert call(ops, "memset_async")[1:3] == [f"{FUSION + 256:#x}", "256"]
    ops.complete_all()
    assert ex.poll()[0]["names"] == ["a", "c"]  # only what this rank has


def test_refusals_come_before_any_work():
    ops, ex = executor()
    with pytest.raises(rr.InvalidInputError, match="cannot run while a rank has joined"):
        ex.execute([tensor("a2a", 8, kind="alltoall", shape=[2, 4], splits=[1, 1],
                           peer_rows=[1, 1])], contributors=1)
    with pytest.raises(rr.InvalidInputError, match="compression to float16 of a int32"):
        ex.execute([tensor("i", 8, dtype=I32, wire=F16)])
    with pytest.raises(rr.InvalidInputError, match="only allreduces"):
        ex.execute([tensor("b", 8, kind="broadcast", root=0, wire=BF16)])
    assert ops.calls() == []


def test_broadcast_from_root():
    ops, ex = executor()
    ex.execute([tensor("w", 16, kind="broadcast", root=1)])
    assert call(ops, "nccl_broadcast")[1:6] == ["0x7000000", "0x8000000", "16", "float32",
                                                "root=1"]


def test_reducescatter_of_divisible_rows_is_one_nccl_call_into_the_output():
    ops, ex = executor(size=2)
    ex.execute([tensor("rs", 8, kind="reducescatter", shape=[4, 2], op=AVG)])
    assert verbs(ops) == ["event_create", "event_record", "stream_wait_event",
                          "nccl_reducescatter", "event_create", "event_record"]
    assert call(ops, "nccl_reducescatter")[1:6] == ["0x7000000", "0x8000000", "4", "float32",
                                                    "avg"]


def test_reducescatter_with_a_prescale_leaves_the_input_alone():
    ops, ex = executor(size=2)
    ex.execute([tensor("rs", 8, kind="reducescatter", shape=[4, 2], prescale=0.5)])
    assert [v for v in verbs(ops) if not v.startswith("event")][1:] == [
        "malloc_device", "memcpy_async", "launch_scale", "nccl_reducescatter"]
    assert call(ops, "memcpy_async")[1:4] == [f"{FUSION:#x}", "0x7000000", "32"]
    assert call(ops, "nccl_reducescatter")[1:4] == [f"{FUSION:#x}", "0x8000000", "4"]


@pytest.mark.parametrize("rank, rows_out", [(0, 2), (1, 2), (2, 1)])
def test_reducescatter_of_ragged_rows_pads_blocks_and_copies_this_ranks_rows(rank, rows_out):
    # 5 rows of 3 floats (12 B) over 3 ranks: 2, 2, 1 rows; blocks of 2 rows (24 B).
    ops = gt.FakeGpuOps()
    ex = gt.GpuExecutor(ops, device=0, rank=rank, size=3)
    ex.init_comm(bytes(128))
    ops.clear_calls()
    ex.execute([tensor("rs", 15, kind="reducescatter", shape=[5, 3], op=SUM,
                       postscale=2.0)])
    pack = call(ops, "launch_pack")
    assert pack[1] == "3" and pack[5:] == [f"0x7000000->{FUSION:#x}:24",
                                           f"0x7000018->{FUSION + 24:#x}:24",
                                           f"0x7000030->{FUSION + 48:#x}:12"]
    assert call(ops, "malloc_device")[1] == str(24 * 4)
    assert call(ops, "nccl_reducescatter")[1:6] == [f"{FUSION:#x}", f"{FUSION + 72:#x}", "6",
                                                    "float32", "sum"]
    assert call(ops, "memcpy_async")[1:4] == ["0x8000000", f"{FUSION + 72:#x}",
                                              str(12 * rows_out)]
    assert call(ops, "launch_scale")[1:5] == ["0x8000000", str(3 * rows_out), "float32", "2"]


@pytest.mark.parametrize("dtype, label", [(F16, "float16"), (BF16, "bfloat16")])
def test_half_precision_tensors_are_fused_and_reduced_in_their_own_type(dtype, label):
    # What Compression.fp16 / .bf16 hand over (cast on the device by torch): 2-byte
    # elements, 256-byte aligned (20 B at 0, 6 B at 256): 131 elements, ncclAvg.
    ops, ex = executor()
    ex.execute([tensor("h0", 10, 0, dtype=dtype, op=AVG, prescale=0.5),
                tensor("h1", 3, 1, dtype=dtype, op=AVG, prescale=0.5)])
    assert call(ops, "launch_scale")[1:5] == [f"{FUSION:#x}", "131", label, "0.5"]
    assert call(ops, "nccl_allreduce")[3:6] == ["131", label, "avg"]


def test_allgather_of_equal_rows_is_one_nccl_call_into_the_output():
    ops, ex = executor(size=3)
    ex.execute([tensor("ag", 8, kind="allgather", shape=[4, 2], peer_rows=[4, 4, 4])])
    assert [v for v in verbs(ops) if not v.startswith(("event", "stream"))] == ["nccl_allgather"]
    assert call(ops, "nccl_allgather")[1:5] == ["0x7000000", "0x8000000", "8", "float32"]


@pytest.mark.parametrize("rank", [0, 2])
def test_allgather_of_ragged_rows_pads_then_compacts_in_one_launch(rank):
    # Rows 2, 3, 0 of 3 floats (12 B): blocks of 3 rows (36 B); output rows 0-1 from
    # rank 0's block, 2-4 from rank 1's; rank 2 sends nothing but takes part.
    rows = [2, 3, 0]
    ops = gt.FakeGpuOps()
    ex = gt.GpuExecutor(ops, device=0, rank=rank, size=3)
    ex.init_comm(bytes(128))
    ops.clear_calls()
    ex.execute([tensor("ag", 3 * rows[rank], kind="allgather", shape=[rows[rank], 3],
                       peer_rows=rows)])
    mine = FUSION + 36 * rank
    assert [v for v in verbs(ops) if not v.startswith(("event", "stream"))] == (
        ["malloc_device"] + (["memcpy_async"] if rows[rank] else []) +
        ["nccl_allgather", "launch_unpack"])
    assert call(ops, "malloc_device")[1] == "108"
    if rows[rank]:
        assert call(ops, "memcpy_async")[1:4] == [f"{mine:#x}", "0x7000000", "24"]
    assert call(ops, "nccl_allgather")[1:4] == [f"{mine:#x}", f"{FUSION:#x}", "9"]
    unpack = call(ops, "launch_unpack")
    assert unpack[1] == "2" and unpack[5:] == [f"{FUSION:#x}->0x8000000:24",
                                               f"{FUSION + 36:#x}->0x8000018:36"]


def test_a_joined_allgather_agrees_on_rows_over_the_host_links():
    # While a rank has joined, every rank learns the row counts from a host allgather in
    # the response's turn (run end to end in test_gpu_arrays.py); an executor without the
    # job's links cannot, and says so. Alltoall is refused (test_refusals_...).
    ops, ex = executor(size=2)
    with pytest.raises(rr.InvalidInputError, match="no host links to agree on the row counts"):
        ex.execute([tensor("x", 4, kind="allgather", peer_rows=[4, 0])], contributors=1)
    assert "nccl_allgather" not in verbs(ops)


def test_alltoall_is_one_nccl_group_of_sends_and_receives_and_a_local_copy():
    # Rank 1 of 3, rows of 2 int32 (8 B): sends 1, 2, 0 rows, receives 3, 2, 0 rows.
    ops = gt.FakeGpuOps()
    ex = gt.GpuExecutor(ops, device=0, rank=1, size=3)
    ex.init_comm(bytes(128))
    ops.clear_calls()
    ex.execute([tensor("a2a", 6, kind="alltoall", shape=[3, 2], dtype=I32, splits=[1, 2, 0],
                       peer_rows=[3, 2, 0])])
    work = [c for c in ops.calls() if not c.startswith(("event", "stream"))]
    assert work == [
        "nccl_group_start",
        "nccl_send 0x7000000 2 int32 peer=0 stream#1",  # row 0 to rank 0
        "nccl_recv 0x8000000 6 int32 peer=0 stream#1",  # 3 rows from rank 0 first
        "nccl_group_end",  # nothing to or from rank 2
        "memcpy_async 0x8000018 0x7000008 16 stream#1",  # its own 2 rows, after rank 0's 3
    ]


def test_close_waits_for_the_stream_and_releases_everything():
    ops, ex = executor()
    ex.execute([tensor("a", 8, 0), tensor("b", 8, 1)])
    ops.complete_all()
    assert ex.poll()[0]["ok"]  # nothing in flight: no abort
    ops.clear_calls()
    ex.close()
    assert verbs(ops) == ["stream_destroy", "event_destroy", "event_destroy", "free_device"]


def test_close_with_work_in_flight_aborts_nccl_before_waiting_for_the_stream():
    # A collective whose peer died never completes: waiting for the stream first would hang.
    ops, ex = executor()
    ex.execute([tensor("a", 4)])
    ops.clear_calls()
    ex.close()
    assert verbs(ops)[:2] == ["nccl_abort", "stream_destroy"]


# ----------------------------------------------------------- fusion by device
def test_fusion_never_mixes_devices():
    ts = [dict(name=n, shape=[4], device=d) for n, d in
          [("a", 0), ("b", 1), ("c", 0), ("h", -1), ("d", 1), ("i", -1)]]
    plan = [r["tensors"] for r in co.plan_fusion(ts, 1 << 20)]
    assert plan == [["a", "c"], ["b", "d"], ["h", "i"]]


def test_negotiated_responses_never_mix_devices():
    neg = co.Negotiator(2)
    for rank in (0, 1):
        for n, d in [("a", 0), ("b", 1), ("c", 0), ("h", -1)]:
            neg.submit(rank, dict(name=n, shape=[4], device=d), 0.0)
    assert [r["tensors"] for r in neg.decide(0.0)] == [["a", "c"], ["b"], ["h"]]


# ------------------------------------------------------------------ the engine
@pytest.fixture
def comm():
    (c,) = make_world(1)
    yield c
    c.close()


def test_engine_completes_gpu_work_only_when_its_event_fires(comm):
    ops = gt.FakeGpuOps()
    gt.use_fake_gpus(comm._engine, {0: ops})
    h = gt.submit(comm._engine, tensor("g", 8), 0)
    end = time.monotonic() + 10
    while not any(c.startswith("nccl_allreduce") for c in ops.calls()):
        assert time.monotonic() < end
        time.sleep(0.001)
    time.sleep(0.05)
    assert not h.done()
    with pytest.raises(rr.InvalidInputError, match="already in flight"):
        gt.submit(comm._engine, tensor("g", 8), 0)  # the name is still taken
    ops.complete_all()
    wait_done(h)
    h.wait()
    h2 = gt.submit(comm._engine, tensor("g", 8), 0)  # released once complete
    ops.complete_all(sticky=True)
    wait_done(h2)
    # the CPU path is untouched alongside
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(comm.allreduce(x, op=rr.Sum, name="cpu"), x)


@pytest.mark.timeout(30)  # a wait that never sees its work enqueued would hang
def test_a_stream_ordered_wait_returns_once_enqueued_and_orders_the_callers_stream(comm):
    # DistributedOptimizer's CUDA wait (as DDP's): the caller's stream waits on the
    # response's completion event; the host does not wait for the device
    ops = gt.FakeGpuOps()
    gt.use_fake_gpus(comm._engine, {0: ops})
    h = gt.submit(comm._engine, tensor("g", 8), 0)
    used = _core.gpu.wait_stream(h, 0x5EED)  # returns although the device has not finished
    assert not h.done()
    assert f"stream#{used}" in ops.calls()[1], ops.calls()  # the executor's stream
    (done,) = [c.split()[1] for c in ops.calls() if c.startswith("event_record")][-1:]
    assert ops.calls()[-1] == f"stream_wait_event stream#{0x5EED} {done}", ops.calls()
    ops.complete_all()
    wait_done(h)
    assert _core.gpu.wait_stream(h, 0x5EED) is None  # done: as wait(), no stream wait
    assert ops.calls()[-1] == f"stream_wait_event stream#{0x5EED} {done}", ops.calls()
    ops.set_async_error("remote process exited or there was a network error (6)")
    h = gt.submit(comm._engine, tensor("g2", 8), 0)
    wait_done(h)  # failed before the wait: the failure is raised, as by wait()
    with pytest.raises(rr.RingReduceError, match="NCCL failed on GPU 0"):
        _core.gpu.wait_stream(h, 0x5EED)


def test_a_failed_job_aborts_the_gpu_work_a_callers_stream_waits_for():
    # Rank 0's NCCL fails after both ranks ordered a stream after their allreduce; rank 1
    # learns it from rank 0 (the job failed), and must abort its own NCCL call, which
    # would otherwise wait for rank 0 forever and the stream with it.
    def fn(c, fakes):
        r = c.rank()
        h = gt.submit(c._engine, tensor("g", 8), r)
        assert _core.gpu.wait_stream(h, 0x5EED) is not None
        c.barrier()  # both have waited on the stream
        if r == 0:
            fakes[0].set_async_error("unhandled cuda error (1)")
        wait_done(h)
        with pytest.raises(rr.RingReduceError):
            h.wait()
        return "nccl_abort" in fakes[r].calls()

    assert fake_gpu_world(2, fn) == [True, True]


def test_engine_keeps_devices_apart(comm):
    fakes = {0: gt.FakeGpuOps(), 1: gt.FakeGpuOps()}
    for f in fakes.values():
        f.complete_all(sticky=True)
    gt.use_fake_gpus(comm._engine, fakes)
    hs = [gt.submit(comm._engine, tensor(f"t{i}", 8, i), i % 2) for i in range(6)]
    for h in hs:
        wait_done(h)
        h.wait()
    for dev, f in fakes.items():
        ins = set()
        for c in f.calls():
            if c.startswith("nccl_allreduce") and c.split()[1] != f"{FUSION:#x}":
                ins.add(int(c.split()[1], 16))
            if c.startswith("launch_pack"):
                ins.update(int(d.split("->")[0], 16) for d in c.split()[5:])
        assert ins == {0x7000000 + i * 0x100000 for i in range(dev, 6, 2)}, f.calls()


def test_engine_fails_entries_with_nccls_async_error(comm):
    ops = gt.FakeGpuOps()
    gt.use_fake_gpus(comm._engine, {0: ops})
    h = gt.submit(comm._engine, tensor("g", 8), 0)
    end = time.monotonic() + 10
    while not any(c.startswith("nccl_allreduce") for c in ops.calls()):
        assert time.monotonic() < end
        time.sleep(0.001)
    ops.set_async_error("remote process exited or there was a network error (6)")
    wait_done(h)
    with pytest.raises(rr.RingReduceError, match="rank 0: NCCL failed on GPU 0: remote process"):
        h.wait()


def test_gpu_tensor_without_a_usable_gpu_fails_clearly_and_the_engine_goes_on(comm):
    h = gt.submit(comm._engine, tensor("g", 8), 0)
    wait_done(h)
    with pytest.raises(rr.InvalidInputError, match="allreduce 'g': the tensor is on GPU 0") as e:
        h.wait()
    reason = _core.gpu.cuda_unusable_reason()
    if reason:  # no CUDA build, no driver, no device: that reason is given
        assert reason in str(e.value)
    else:  # a GPU and NCCL: the communicator's bootstrap is what is missing
        assert "NCCL" in str(e.value)
    h = gt.submit(comm._engine, tensor("g2", 8), 0)  # same answer, remembered
    wait_done(h)
    with pytest.raises(rr.InvalidInputError, match="GPU 0"):
        h.wait()
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(comm.allreduce(x, op=rr.Sum, name="after"), x)


# ------------------------------------------------- hierarchical (fake hosts)
def hierarchical_on_fake_hosts(hosts, id_seed):
    """One Average allreduce of 11 floats with RINGREDUCE_HIERARCHICAL_ALLREDUCE=1, a rank
    per entry of ``hosts`` (its fake host), each on a FakeGpuOps of its own; asserts
    every rank ran it hierarchically and returns the fakes."""
    from conftest import env

    fakes = [gt.FakeGpuOps(id_seed=id_seed + r) for r in range(len(hosts))]
    for f in fakes:
        f.complete_all(sticky=True)
    with env(RINGREDUCE_HIERARCHICAL_ALLREDUCE="1"):
        world = make_world(len(hosts), hosts)
    for r, c in enumerate(world):
        gt.use_fake_gpus(c._engine, {r: fakes[r]}, bootstrap=True)

    def fn(c):
        gt.submit(c._engine, {**tensor("h", 11), "op": AVG}, c.rank()).wait()
        return c._engine.stats()["hierarchical_allreduces"]

    try:
        assert run_threaded(len(hosts), fn, world=world, timeout=60) == [1] * len(hosts)
    finally:
        for c in world:
            c.close()
    return fakes


def test_hierarchical_allreduce_splits_reduce_scatter_host_ring_allgather():
    # 4 ranks on 2 fake hosts, RINGREDUCE_HIERARCHICAL_ALLREDUCE=1: 11 floats, 2 shards of
    # 6 (one padding float zeroed), shard l of local rank l across hosts on the host.
    for r, f in enumerate(hierarchical_on_fake_hosts(["a", "a", "b", "b"], 0x70)):
        mine = FUSION + 24 * (r % 2)
        work = [c for c in f.calls() if c.split()[0] in (
            "nccl_comm_init", "memset_async", "nccl_reducescatter", "memcpy_async",
            "nccl_allgather", "nccl_allreduce", "launch_scale")]
        assert [w.split()[0] for w in work] == [
            "nccl_comm_init",  # the job's, at its first response
            "memset_async", "nccl_comm_init",  # padding; the host's communicator
            "nccl_reducescatter", "memcpy_async", "memcpy_async", "nccl_allgather",
            "launch_scale"]  # Average ran as Sum: 1 / 4 afterwards
        assert work[0].endswith(f"size=4 rank={r}") and work[2].endswith(f"size=2 rank={r % 2}")
        assert work[1].split()[1:3] == [f"{FUSION + 44:#x}", "4"]
        assert work[3].split()[1:6] == [f"{FUSION:#x}", f"{mine:#x}", "6", "float32", "sum"]
        assert work[4].split()[2:4] == [f"{mine:#x}", "24"]  # to the host
        assert work[5].split()[1] == f"{mine:#x}"  # back
        assert work[6].split()[1:4] == [f"{mine:#x}", f"{FUSION:#x}", "6"]
        assert work[7].split()[1:5] == [f"{FUSION:#x}", "11", "float32", "0.25"]


def test_hierarchical_allreduce_on_hosts_of_unequal_rank_counts():
    # 5 ranks, hosts of 2 and 3: 6 units (lcm) of 2 floats, 11 floats padded to 12. Host a's
    # ranks own 3 units (6 floats), host b's 2 units (4 floats); the NCCL counts differ per
    # host, each host's ranks agree. Across hosts, rank 0's units 0-3 meet two owners on
    # host b (units 0-2: rank 2, unit 2: rank 3): two CPU rings, in unit order.
    for r, f in enumerate(hierarchical_on_fake_hosts(["a", "a", "b", "b", "b"], 0x50)):
        shard, local = (6, r) if r < 2 else (4, r - 2)
        mine = FUSION + 4 * shard * local
        work = [c for c in f.calls() if c.split()[0] in (
            "memset_async", "nccl_reducescatter", "memcpy_async", "nccl_allgather",
            "launch_scale")]
        assert [w.split()[0] for w in work] == [
            "memset_async", "nccl_reducescatter", "memcpy_async", "memcpy_async",
            "nccl_allgather", "launch_scale"]
        assert work[0].split()[1:3] == [f"{FUSION + 44:#x}", "4"]  # 1 float of padding
        assert work[1].split()[1:6] == [f"{FUSION:#x}", f"{mine:#x}", str(shard), "float32",
                                        "sum"]
        assert work[2].split()[2:4] == [f"{mine:#x}", str(4 * shard)]
        assert work[4].split()[1:4] == [f"{mine:#x}", f"{FUSION:#x}", str(shard)]
        assert work[5].split()[1:4] == [f"{FUSION:#x}", "11", "float32"]  # then 1 / 5
        inits = [c for c in f.calls() if c.startswith("nccl_comm_init")]
        assert inits[1].endswith(f"size={2 if r < 2 else 3} rank={local}")  # the host's


def test_a_broken_gpu_on_one_rank_fails_every_rank_at_once():
    # Rank 0's communicator reports an NCCL asynchronous error; rank 1's NCCL call would
    # wait for rank 0 forever (over P2P nothing tells it: its fake event never fires).
    # Rank 0's engine fails as a whole and tells every peer, so rank 1's call raises
    # within seconds, naming rank 0 and NCCL's message, instead of hanging.
    def fn(c, fakes):
        h = gt.submit(c._engine, tensor("g", 8), c.rank())
        end = time.monotonic() + 10
        while not any(x.startswith("nccl_allreduce") for x in fakes[c.rank()].calls()):
            assert time.monotonic() < end
            time.sleep(0.001)
        if c.rank() == 0:
            fakes[0].set_async_error("unhandled cuda error (1)")
        t = time.monotonic()
        with pytest.raises(rr.RingReduceError) as err:
            h.wait()
        return str(err.value), time.monotonic() - t

    (m0, _), (m1, t1) = fake_gpu_world(2, fn)
    assert "rank 0: NCCL failed on GPU 0: unhandled cuda error (1)" in m0, m0
    assert "rank 0" in m1 and "unhandled cuda error (1)" in m1 and t1 < 10, (m1, t1)


def test_a_failure_reports_once_enqueued_work_has_drained_or_the_bound_passed():
    # After an NCCL error the communicator is aborted and the work queued behind it still
    # runs (an unpack writes the outputs): the handles fail only once it has, else the
    # framework could reuse their memory under a late write. A device that never drains
    # is reported after drain_seconds.
    for drains, least in [(True, 0.0), (False, 0.3)]:
        ops = gt.FakeGpuOps(NCCL_2_27)
        ops.set_abort_drains(drains)
        ex = gt.GpuExecutor(ops, device=0, rank=0, size=2, drain_seconds=0.3)
        ex.init_comm(bytes(128))
        ex.execute([tensor("a", 8, 0), tensor("b", 8, 1)])
        ops.set_async_error("unhandled system error (2)")
        t = time.monotonic()
        (c,) = ex.poll()
        took = time.monotonic() - t
        assert not c["ok"] and c["names"] == ["a", "b"]
        assert least <= took < least + 0.25, (drains, took)
