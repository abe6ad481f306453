"""fp16 / bf16 compression through the GPU executor's cast kernels, and a joined rank's
neutral elements on GPU, planned over FakeGpuOps (csrc/gpu/gpu_allreduce_compressed.cc):
the launches, their dtypes and scale factors, the NCCL call's dtype and count. Also the
negotiation of the compression (``wire``) and the CPU reference of the casting kernels.
End to end on emulated GPUs: tests/test_gpu_arrays.py."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_fakes import (
    AVG,
    BF16,
    F16,
    F32,
    F64,
    FUSION,
    I32,
    MAX,
    MIN,
    PROD,
    SUM,
    call,
    executor,
    tensor,
    verbs,
)
from ringreduce._core import coordination as co

from ringreduce import _core

CODES = {np.float32: F32, np.float64: F64}


def test_compressed_fused_allreduce_casts_in_one_pack_and_one_unpack():
    ops, ex = executor()
    ts = [tensor(f"t{i}", n, i, stream=7, prescale=0.5, postscale=3.0, op=AVG, wire=F16)
          for i, n in enumerate([10, 1000, 3])]
    ex.execute(ts)
    assert verbs(ops) == [
        "event_create", "event_record", "stream_wait_event", "malloc_device",
        "launch_pack_cast", "nccl_allreduce", "launch_unpack_cast",  # no scale launches
        "event_create", "event_record"]
    # The layout is over float16 bytes: 20, 2000, 6 at offsets 0, 256, 2304 (256-aligned).
    pack = call(ops, "launch_pack_cast")
    assert pack[1:4] == ["float32->float16", "x0.5", "3"]  # prescale folded into the cast
    assert pack[7:] == [f"0x7000000->{FUSION:#x}:20", f"0x7100000->{FUSION + 256:#x}:2000",
                        f"0x7200000->{FUSION + 2304:#x}:6"]
    # NCCL reduces 1155 float16 (2310 bytes); Average runs as Sum on the wire ...
    assert call(ops, "nccl_allreduce")[1:6] == [f"{FUSION:#x}", f"{FUSION:#x}", "1155",
                                                "float16", "sum"]
    # ... and 1 / 2 joins the postscale in the unpack, computed in float32.
    unpack = call(ops, "launch_unpack_cast")
    assert unpack[1:4] == ["float16->float32", "x1.5", "3"]
    assert unpack[7:] == [f"{FUSION:#x}->0x8000000:20", f"{FUSION + 256:#x}->0x8100000:2000",
                          f"{FUSION + 2304:#x}->0x8200000:6"]
    assert pack[4] == unpack[4] and pack[4] != "0x0"  # one launch shape, from the plan


def test_a_single_compressed_tensor_also_goes_through_the_casts():
    ops, ex = executor()
    ex.execute([tensor("w", 5, dtype=F64, wire=BF16, op=SUM)])
    assert call(ops, "launch_pack_cast")[1:4] == ["float64->bfloat16", "x1", "1"]
    assert call(ops, "launch_pack_cast")[7:] == [f"0x7000000->{FUSION:#x}:10"]
    assert call(ops, "nccl_allreduce")[3:6] == ["5", "bfloat16", "sum"]
    assert call(ops, "launch_unpack_cast")[7:] == [f"{FUSION:#x}->0x8000000:10"]


def test_compressed_chunks_count_wire_bytes_and_step_the_tensor_by_its_own():
    ops, ex = executor(chunk_bytes=1024)
    ex.execute([tensor("big", 1000, wire=F16)])  # 2000 wire bytes: chunks of 1024 and 976
    assert call(ops, "launch_pack_cast")[7:] == [
        f"0x7000000->{FUSION:#x}:1024", f"0x7000800->{FUSION + 1024:#x}:976"]  # 512 x 4 B


def test_compressed_with_a_joined_rank_fills_the_wire_dtype():
    ops, ex = executor()
    ex.execute([tensor("a", 8, 0, op=MIN, wire=F16),
                {**tensor("b", 8, 1, op=MIN, wire=F16), "in": None}], contributors=1)
    assert call(ops, "launch_pack_cast")[3] == "1"  # only what this rank has
    assert call(ops, "launch_fill")[1:5] == [f"{FUSION + 256:#x}", "8", "x2B", "0x7c00"]
    assert verbs(ops).index("launch_fill") < verbs(ops).index("nccl_allreduce")


@pytest.mark.parametrize("op,dtype,pattern", [
    (MIN, F32, "0x7f800000"), (MAX, F32, "0xff800000"), (PROD, F32, "0x3f800000"),
    (MIN, I32, "0x7fffffff"), (PROD, F16, "0x3c00"), (MAX, BF16, "0xff80")])
def test_a_joined_rank_contributes_neutral_elements(op, dtype, pattern):
    ops, ex = executor()
    ex.execute([tensor("a", 8, 0, op=op, dtype=dtype, prescale=2.0),
                {**tensor("b", 8, 1, op=op, dtype=dtype, prescale=2.0), "in": None}],
               contributors=1)
    fill = call(ops, "launch_fill")
    assert fill[1:5] == [f"{FUSION + 256:#x}", "8", f"x{'24'[dtype in (F32, I32)]}B", pattern]
    v = verbs(ops)  # after the prescale, which must not scale the neutral elements
    assert v.index("launch_scale") < v.index("launch_fill") < v.index("nccl_allreduce")


def test_a_joined_rank_alone_fills_its_scratch_tensor():
    ops, ex = executor()
    ex.execute([{**tensor("p", 6, op=PROD), "in": None}], contributors=1)
    assert verbs(ops) == ["malloc_device", "launch_fill", "nccl_allreduce", "event_create",
                          "event_record"]
    assert call(ops, "launch_fill")[2:5] == ["6", "x4B", "0x3f800000"]


def test_ranks_must_agree_on_the_compression():
    neg = co.Negotiator(2)
    neg.submit(0, dict(name="g", device=0, wire=F16), 0.0)
    neg.submit(1, dict(name="g", device=0), 0.0)
    (r,) = neg.decide(0.0)
    assert r["type"] == "error" and "compression=float16" in r["message"]
    assert "rank 1 called" in r["message"]


def test_fusion_keeps_compressed_and_plain_tensors_apart():
    ts = [dict(name=n, shape=[4], device=0, wire=w) for n, w in
          [("a", F16), ("b", -1), ("c", F16), ("d", BF16), ("e", -1)]]
    plan = [r["tensors"] for r in co.plan_fusion(ts, 1 << 20)]
    assert plan == [["a", "c"], ["b", "e"], ["d"]]


# ------------------------------------------- the casting kernels' CPU reference
G = _core.gpu


def descs(tensor, wire, chunk):
    """Descriptors of compression's pack / unpack between ``tensor`` and ``wire`` (numpy
    arrays of equal length), ``chunk`` wire bytes each, as the executor makes them."""
    rows, ti, wi = [], tensor.itemsize, wire.itemsize
    for done in range(0, wire.nbytes, chunk):
        n = min(chunk, wire.nbytes - done)
        rows.append([tensor.ctypes.data + done // wi * ti, wire.ctypes.data + done, n])
    return np.array(rows, np.uint64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reference_pack_cast_scales_then_rounds_once_to_float16(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(10_001) * 100).astype(dtype)
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    wire = np.zeros(x.size, np.float16)
    G.reference_cast_copy(descs(x, wire, 4096), True, CODES[dtype], F16, 0.5)
    np.testing.assert_array_equal(wire, (x * dtype(0.5)).astype(np.float16))
    back = np.zeros_like(x)
    G.reference_cast_copy(descs(back, wire, 4096), False, CODES[dtype], F16, 3.0)
    np.testing.assert_array_equal(back, wire.astype(dtype) * dtype(3.0))  # in the wide type


def test_reference_pack_cast_to_bfloat16_and_nan_stays_nan():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([1 + 2**-9, -2.5, np.nan, 3e38, 1e-40], np.float32)
    wire = np.zeros(x.size, np.uint16)
    G.reference_cast_copy(descs(x, wire, 16), True, F32, BF16, 1.0)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.isnan(wire.view(ml_dtypes.bfloat16)[2].astype(np.float32))
    np.testing.assert_array_equal(np.delete(wire, 2), np.delete(want, 2))


def test_reference_fill_repeats_one_elements_bits():
    for item, dtype in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)):
        a = np.zeros(9, dtype)
        G.reference_fill(a, item, 0x0123456789ABCDEF)
        assert np.all(a == dtype(0x0123456789ABCDEF & ((1 << (8 * item)) - 1)))
    with pytest.raises(ValueError, match="not whole elements"):
        G.reference_fill(np.zeros(3, np.uint8), 2, 0)
