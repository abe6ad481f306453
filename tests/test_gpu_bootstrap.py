"""The NCCL communicator's bootstrap (csrc/gpu/gpu_bootstrap.cc) over the engine's own
links, at np=2 with ranks as threads and FakeGpuOps as each rank's GPU: rank 0's unique
id reaches every rank's ncclCommInitRank, each rank on its own GPU; a rank without a GPU,
or rank 0 failing to make the id, fails the tensor on every rank alike, and the engines
go on in step."""

from __future__ import annotations

import numpy as np
from ringreduce._core.gpu import testing as gt

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded

F32, SUM = 6, 0


def gpu_tensor(name):
    return {"name": name, "shape": [4], "dtype": F32, "op": SUM, "in": 0x7000000,
            "out": 0x7000000}


def run(fakes, bootstrap=True):
    """Every rank r submits one allreduce on its GPU r; returns each rank's outcome."""
    world = make_world(2)
    for r, c in enumerate(world):
        gt.use_fake_gpus(c._engine, {r: fakes[r]} if fakes[r] else {}, bootstrap=bootstrap)

    def fn(c):
        h = gt.submit(c._engine, gpu_tensor("g"), c.rank())
        try:
            h.wait()
            out = "ok"
        except rr.InvalidInputError as e:
            out = str(e)
        x = np.full(3, c.rank() + 1.0, np.float32)  # the CPU path goes on, in step
        np.testing.assert_array_equal(c.allreduce(x, op=rr.Sum, name="after"), np.full(3, 3.0))
        return out

    try:
        return run_threaded(2, fn, world=world, timeout=60)
    finally:
        for c in world:
            c.close()


def test_rank_zeros_id_reaches_every_rank_on_its_own_gpu():
    fakes = [gt.FakeGpuOps(id_seed=0x70 + r) for r in range(2)]
    for f in fakes:
        f.complete_all(sticky=True)
    assert run(fakes) == ["ok", "ok"]
    assert fakes[0].calls()[0] == "nccl_unique_id -> 70010000"
    assert not any(c.startswith("nccl_unique_id") for c in fakes[1].calls())
    for r, f in enumerate(fakes):
        calls = f.calls()
        assert f"set_device {r}" in calls
        assert f"nccl_comm_init id=128B:70010000 size=2 rank={r}" in calls
        assert [c.split()[0] for c in calls].count("nccl_allreduce") == 1


def test_a_rank_without_a_gpu_fails_the_tensor_on_every_rank():
    fakes = [gt.FakeGpuOps(), None]
    msgs = run(fakes)
    for r, m in enumerate(msgs):
        assert f"rank {r}: allreduce 'g': the tensor is on GPU {r}" in m, m
        assert "GPU collectives need every rank to have a GPU (rank 1: no fake for GPU 1)" in m
    assert not any(c.startswith("nccl") for c in fakes[0].calls())


def test_rank_zero_failing_to_make_the_id_fails_every_rank():
    fakes = [gt.FakeGpuOps(), gt.FakeGpuOps()]
    fakes[0].fail_next("nccl_unique_id", "ncclGetUniqueId failed: unhandled system error")
    msgs = run(fakes)
    for m in msgs:
        assert "rank 0 could not make an NCCL unique id: ncclGetUniqueId failed" in m, m
    assert not any(c.startswith("nccl_comm_init") for f in fakes for c in f.calls())


def test_a_process_sets_communicator_is_made_among_its_members_only():
    # Rank 1's set {1} on GPU first (rank 0 takes no part), then the job's communicator.
    fakes = [gt.FakeGpuOps(id_seed=0x70 + r) for r in range(2)]
    for f in fakes:
        f.complete_all(sticky=True)
    world = make_world(2)
    for r, c in enumerate(world):
        gt.use_fake_gpus(c._engine, {r: fakes[r]}, bootstrap=True)

    def fn(c):
        if c.rank() == 1:
            gt.submit(c._engine, {**gpu_tensor("s"), "members": [1]}, 1).wait()
        gt.submit(c._engine, gpu_tensor("g"), c.rank()).wait()

    try:
        run_threaded(2, fn, world=world, timeout=60)
    finally:
        for c in world:
            c.close()
    inits = [[c for c in f.calls() if c.startswith("nccl_comm_init")] for f in fakes]
    assert inits[0] == ["nccl_comm_init id=128B:70010000 size=2 rank=0"]
    assert inits[1] == ["nccl_comm_init id=128B:71010000 size=1 rank=0",  # the set's, its id
                        "nccl_comm_init id=128B:70010000 size=2 rank=1"]
