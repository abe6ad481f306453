"""Process sets (ringreduce/process_sets.py, Horovod's ``hvd.ProcessSet``): each set
negotiates and reduces among its members only, over a group view of the job's links; sets
run side by side; non-members get a clear error. Threads as ranks here; real processes in
test_process_sets_processes below."""

from __future__ import annotations

import numpy as np
import pytest
from procs import run_env_launch, run_mpi

import ringreduce as rr
from ringreduce import ProcessSet
from ringreduce.testing import make_world, run_threaded


def threaded(n: int, fn, sets=None):
    """Run fn(comm, sets) on n threaded ranks, each with its own registered copies of
    ``sets`` (lists of ranks) and the module functions bound to its communicator."""
    comms = make_world(n)

    def body(c):
        mine = [ProcessSet(s) for s in sets or []]
        c.process_sets.setup(mine)
        with rr.use_communicator(c):
            return fn(c, mine)
    try:
        return run_threaded(n, body, world=comms, return_exceptions=True)
    finally:
        for c in comms:
            c.close()


def value(rank: int, k: int = 5) -> np.ndarray:
    return np.arange(k, dtype=np.float32) + 10 * rank


def every_collective(ps: ProcessSet) -> dict:
    """One call of each collective on ``ps``, with results that depend on its members."""
    r = rr.rank()
    out = {
        "sum": rr.allreduce(value(r), op=rr.Sum, process_set=ps),
        "avg": rr.allreduce(value(r), process_set=ps),
        "gather": rr.allgather(np.full((r + 1, 2), r, np.int32), process_set=ps),
        "bcast": rr.broadcast(value(r), root_rank=ps.size() - 1, process_set=ps),
        "scatter": rr.reducescatter(np.ones((2 * ps.size(), 3)) * r, op=rr.Sum, process_set=ps),
        "a2a": rr.alltoall(np.full(ps.size(), r, np.int64), process_set=ps),
        "grouped": rr.grouped_allreduce([value(r, 3), value(r, 70000)], op=rr.Max,
                                        process_set=ps),
        "ggather": rr.grouped_allgather([np.full((r + 1, 2), r, np.int32)], process_set=ps),
        "gscatter": rr.grouped_reducescatter([np.ones((2 * ps.size(), 3)) * r], op=rr.Sum,
                                             process_set=ps),
        "obj": rr.allgather_object({"rank": r}, process_set=ps),
        "bobj": rr.broadcast_object(f"from {r}", root_rank=0, process_set=ps),
    }
    rr.barrier(process_set=ps)
    return out


def check_every_collective(got: dict, members: list, me: int) -> None:
    k = len(members)
    np.testing.assert_array_equal(got["sum"], sum(value(m) for m in members))
    np.testing.assert_allclose(got["avg"], sum(value(m) for m in members) / k)
    want_rows = np.concatenate([np.full((m + 1, 2), m, np.int32) for m in members])
    np.testing.assert_array_equal(got["gather"], want_rows)
    np.testing.assert_array_equal(got["bcast"], value(members[-1]))
    np.testing.assert_array_equal(got["scatter"], np.full((2, 3), float(sum(members))))
    np.testing.assert_array_equal(got["a2a"], np.array(members, np.int64))
    np.testing.assert_array_equal(got["grouped"][1], value(max(members), 70000))
    np.testing.assert_array_equal(got["ggather"][0], want_rows)
    np.testing.assert_array_equal(got["gscatter"][0], got["scatter"])
    assert got["obj"] == [{"rank": m} for m in members]
    assert got["bobj"] == f"from {members[0]}"


@pytest.mark.parametrize("n, sets", [(2, [[1], [0, 1]]), (3, [[0, 2], [1, 2]])])
def test_static_sets_run_every_collective_among_members(n, sets):
    def body(c, mine):
        res = {}
        for ps in mine:
            assert ps.included() == (c.rank() in ps.ranks) and ps.size() == len(ps.ranks)
            if ps.included():
                assert ps.rank() == ps.ranks.index(c.rank())
                res[ps.process_set_id] = every_collective(ps)
            else:
                assert ps.rank() is None
        res[0] = every_collective(rr.global_process_set)
        return res

    results = threaded(n, body, sets)
    for r, res in enumerate(results):
        assert not isinstance(res, BaseException), res
        check_every_collective(res[0], list(range(n)), r)
        for pid, members in enumerate(sets, start=1):
            assert (pid in res) == (r in members)
            if pid in res:
                check_every_collective(res[pid], members, r)


def test_overlapping_sets_run_concurrently_and_non_members_are_refused():
    """Ranks 0 and 2 each drive their own set while rank 1, in both, interleaves them with
    async calls, and the global set runs among them; rank 0 calling into {1,2} is refused."""
    def body(c, mine):
        a, b = mine
        r, hs = c.rank(), []
        for i in range(20):
            if a.included():
                hs.append(("a", i, rr.allreduce_async(value(r, 1000), op=rr.Sum,
                                                      name=f"a{i}", process_set=a)))
            if b.included():
                hs.append(("b", i, rr.allreduce_async(value(r, 1000), op=rr.Sum,
                                                      name=f"b{i}", process_set=b)))
        out = {(s, i): rr.synchronize(h) for s, i, h in hs}
        out["global"] = rr.allreduce(value(r), op=rr.Sum)
        if r == 0:
            with pytest.raises(rr.InvalidInputError, match="rank 0 is not a member of process "
                               r"set 2 \(ranks \[1, 2\]\)"):
                rr.allreduce(value(r), process_set=b)
        return out

    results = threaded(3, body, [[0, 1], [1, 2]])
    for r, out in enumerate(results):
        assert not isinstance(out, BaseException), out
        np.testing.assert_array_equal(out["global"], value(0) + value(1) + value(2))
        for i in range(20):
            if r in (0, 1):
                np.testing.assert_array_equal(out[("a", i)], value(0, 1000) + value(1, 1000))
            if r in (1, 2):
                np.testing.assert_array_equal(out[("b", i)], value(1, 1000) + value(2, 1000))


def test_a_members_refusal_names_its_job_rank_and_its_set_rank():
    def fn(c, sets):
        if rr.rank() == 0:
            return None
        try:  # global rank 2, the set's rank 1, gives a root outside the set
            rr.broadcast(np.ones(3), root_rank=5 if rr.rank() == 2 else 1, name="y",
                         process_set=sets[0])
        except rr.RingReduceError as e:
            return f"{type(e).__name__}: {e}"
        return "completed"

    _, one, two = threaded(3, fn, sets=[[1, 2]])
    who = "rank 2 (rank 1 of process set [1, 2]): broadcast 'y': root_rank must be an int in " \
          "[0, 2) (a rank of the process set, as in Horovod), got 5"
    assert two == f"InvalidInputError: {who}"
    assert one.startswith("MismatchError: rank 1: ") and f"refused this call locally: {who}" in one


def test_dynamic_sets_add_remove_and_disagreement():
    def body(c, _):
        with pytest.raises(rr.InvalidInputError, match="dynamic process sets"):
            rr.add_process_set([0, 1])
        c.process_sets.setup("dynamic")
        odd = rr.add_process_set([1])
        pair = rr.add_process_set(ProcessSet([0, 1]))
        assert (odd.process_set_id, pair.process_set_id) == (1, 2)
        got = rr.allreduce(np.array([c.rank() + 1.0]), op=rr.Sum, process_set=pair)
        assert repr(pair) == "ProcessSet(process_set_id=2, ranks=[0, 1])"
        assert rr.remove_process_set(odd) and odd.process_set_id is None
        with pytest.raises(rr.MismatchError, match="rank 0: \\[0\\]; rank 1: \\[1\\]"):
            rr.add_process_set([c.rank()])
        return float(got[0])

    assert threaded(2, body) == [3.0, 3.0]


def test_join_on_a_process_set():
    """join(process_set={0,2}) at np=3: rank 0 joins after one allreduce; rank 2's later
    allreduce (Sum and Average), allgather and broadcast take neutral contributions from
    it; both get the global rank of the last member to join (Horovod's); rank 1 (not a
    member) is untouched; then unnamed calls on the set agree again (a new epoch)."""
    def body(c, mine):
        (ps,) = mine
        r, out = c.rank(), {}
        if r == 0:
            out["first"] = rr.allreduce(value(r), op=rr.Sum, process_set=ps)
            out["join"] = rr.join(process_set=ps)
        elif r == 2:
            out["first"] = rr.allreduce(value(r), op=rr.Sum, process_set=ps)
            out["sum"] = rr.allreduce(value(r), op=rr.Sum, process_set=ps)
            out["avg"] = rr.allreduce(value(r), op=rr.Average, process_set=ps)
            out["gather"] = rr.allgather(np.full((2, 3), r, np.int32), process_set=ps)
            out["bcast"] = rr.broadcast(value(r), root_rank=1, process_set=ps)
            out["join"] = rr.join(process_set=ps)
        if ps.included():
            out["after"] = rr.allreduce(value(r), op=rr.Sum, process_set=ps)
        out["global"] = rr.allreduce(value(r), op=rr.Sum)
        return out

    results = threaded(3, body, [[0, 2]])
    for out in results:
        assert not isinstance(out, BaseException), out
        np.testing.assert_array_equal(out["global"], value(0) + value(1) + value(2))
    r0, r1, r2 = results
    assert r0["join"] == r2["join"] == 2 and "join" not in r1
    for out in (r0, r2):
        np.testing.assert_array_equal(out["first"], value(0) + value(2))
        np.testing.assert_array_equal(out["after"], value(0) + value(2))
    np.testing.assert_array_equal(r2["sum"], value(2))
    np.testing.assert_array_equal(r2["avg"], value(2))
    np.testing.assert_array_equal(r2["gather"], np.full((2, 3), 2, np.int32))
    np.testing.assert_array_equal(r2["bcast"], value(2))


PS_WORKER = "process_sets_worker.py"


@pytest.mark.parametrize("launch, n", [("env", 2), ("mpirun", 3)])
def test_process_sets_processes(launch, n):
    """Real processes: static sets at init, a dynamic one, numpy and torch."""
    job = (run_env_launch(n, PS_WORKER, timeout=120) if launch == "env" else
           run_mpi(n, PS_WORKER, timeout=120))
    job.check_ok(expect_ranks=n)
