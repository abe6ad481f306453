"""Unit tier of the engine: the coordinator's negotiation state machine, the
fusion planner and the response cache, fed canned requests (no I/O)."""

from __future__ import annotations

import math

import pytest
from ringreduce._core import coordination as co

F32, F16 = 6, 4
SUM, AVG = 0, 1


def t(name, n=4, **kw):
    return dict(name=name, shape=[n], **kw)


def test_ready_only_when_every_rank_submitted_in_first_seen_order():
    neg = co.Negotiator(3)
    neg.submit(1, t("b"), 0.0)
    neg.submit(0, t("a"), 0.0)
    neg.submit(2, t("a"), 0.0)
    neg.submit(0, t("b"), 0.1)
    assert neg.decide(0.2) == [] and neg.pending == 2  # 'a' misses rank 1, 'b' rank 2
    neg.submit(2, t("b"), 0.3)
    neg.submit(1, t("a"), 0.3)
    out = neg.decide(0.4)
    # both ready now: fused into one response, in the order first seen ('b' first)
    assert [r["tensors"] for r in out] == [["b", "a"]]
    assert out[0]["type"] == "exec" and out[0]["contributors"] == 3
    assert neg.pending == 0


@pytest.mark.parametrize("field, a, b, shown", [
    ("shape", [4], [5], "float32[5]"),
    ("dtype", F32, F16, "float16"),
    ("op", SUM, AVG, "op=Average"),
    ("kind", "allreduce", "broadcast", "broadcast"),
    ("prescale", 1.0, 2.0, "prescale=2"),
])
def test_mismatch_is_an_error_response_naming_each_rank(field, a, b, shown):
    neg = co.Negotiator(2)
    neg.submit(0, {**t("x"), field: a, "root": 0}, 0.0)
    neg.submit(1, {**t("x"), field: b, "root": 0}, 0.0)
    (r,) = neg.decide(0.0)
    assert r["type"] == "error" and r["tensors"] == ["x"]
    assert "rank 0 called" in r["message"] and "rank 1 called" in r["message"]
    assert shown in r["message"]


def test_allgather_may_differ_in_first_dimension_only():
    neg = co.Negotiator(2)
    neg.submit(0, dict(name="g", kind="allgather", shape=[2, 3]), 0.0)
    neg.submit(1, dict(name="g", kind="allgather", shape=[5, 3]), 0.0)
    assert neg.decide(0.0)[0]["type"] == "exec"
    neg.submit(0, dict(name="h", kind="allgather", shape=[2, 3]), 0.0)
    neg.submit(1, dict(name="h", kind="allgather", shape=[2, 4]), 0.0)
    assert neg.decide(0.0)[0]["type"] == "error"


def test_join_counts_joined_ranks_as_ready_and_reports_the_last():
    neg = co.Negotiator(3)
    neg.join(2)
    neg.submit(0, t("x"), 0.0)
    neg.submit(1, t("x"), 0.0)
    (r,) = neg.decide(0.0)
    assert r["type"] == "exec" and r["contributors"] == 2
    neg.join(0)
    neg.submit(1, t("y"), 0.0)
    out = neg.decide(0.0)
    assert out[0]["tensors"] == ["y"] and out[0]["contributors"] == 1
    neg.join(1)
    (done,) = neg.decide(0.0)
    assert done["type"] == "join-done" and done["last_joined"] == 1
    neg.submit(0, t("z"), 0.0)  # the joined set was reset
    assert neg.decide(0.0) == []


def test_join_of_a_process_set_waits_for_its_members_only():
    """join(process_set=[0, 2]) at size 3: the set's tensors take rank 2 as joined, the
    global set's do not; once both members joined, join-done names the set and reports the
    global rank of the last one."""
    neg = co.Negotiator(3)
    neg.join(2, 0.0, [0, 2])
    neg.submit(0, t("s", members=[0, 2]), 0.0)
    neg.submit(0, t("g"), 0.0)
    neg.submit(1, t("g"), 0.0)
    (r,) = neg.decide(0.0)  # 's' ready without rank 2; 'g' still waits for it
    assert r["tensors"] == ["s"] and r["contributors"] == 1 and neg.pending == 1
    neg.join(0, 0.1, [0, 2])
    (done,) = neg.decide(0.1)
    assert done["type"] == "join-done" and done["last_joined"] == 0, done
    assert done["tensors"] == ["join@[0,2]"]
    neg.submit(0, t("s2", members=[0, 2]), 0.2)  # the set's join state was reset
    assert neg.decide(0.2) == []


def test_a_tensor_submitted_with_the_last_join_runs_before_the_join_completes():
    """Rank 0 submits 'x' and then joins, in the round in which rank 1 (already joined)
    makes everyone joined: 'x' must run (rank 1 contributing neutral elements) before
    join-done, or its handle would never complete."""
    neg = co.Negotiator(2)
    neg.join(1)
    neg.submit(0, t("x"), 0.0)
    neg.join(0)
    out = neg.decide(0.0)
    assert [r["type"] for r in out] == ["exec", "join-done"]
    assert out[0]["tensors"] == ["x"] and out[0]["contributors"] == 1
    assert neg.pending == 0


def test_a_stall_report_does_not_count_joined_ranks_as_missing():
    neg = co.Negotiator(3, stall_check=1.0)
    neg.join(2)
    neg.submit(0, t("x"), 0.0)
    (w,) = neg.decide(2.0)
    assert w["type"] == "stall-warning", w
    assert "submitted by rank 0, missing on rank 1," in w["message"], w["message"]


def test_process_set_tensors_wait_for_members_only_and_never_fuse_across_sets():
    neg = co.Negotiator(4, stall_check=1.0)
    neg.submit(1, t("a", members=[1, 3]), 0.0)
    neg.submit(0, t("g"), 0.0)  # the whole job's: waits for everyone
    neg.submit(0, t("b", members=[0, 2]), 0.0)
    (w,) = neg.decide(2.0)  # a stall report names the missing members only
    assert "'a' (allreduce) submitted by rank 1, missing on rank 3," in w["message"], w
    assert "'b' (allreduce) submitted by rank 0, missing on rank 2," in w["message"]
    neg.submit(3, t("a", members=[1, 3]), 2.1)
    neg.submit(2, t("b", members=[0, 2]), 2.1)
    out = neg.decide(2.2)
    assert [(r["tensors"], r["contributors"]) for r in out] == [(["a"], 2), (["b"], 2)]
    neg.submit(1, t("c", members=[1, 3]), 2.3)
    neg.submit(3, t("c", members=[1, 2, 3]), 2.3)  # another set under the same name
    (r,) = neg.decide(2.4)
    assert r["type"] == "error" and "process_set=[1,2,3]" in r["message"], r


def test_join_with_process_sets_checks_the_root_within_the_set():
    neg = co.Negotiator(3)
    neg.join(2)
    neg.submit(1, t("b", kind="broadcast", root=1, members=[1, 2]), 0.0)
    (r,) = neg.decide(0.0)  # root 1 of the set is global rank 2, which joined
    assert r["type"] == "error" and r["message"].endswith(
        "root rank 1 of the process set (rank 2) has already joined"), r


def test_join_rejects_collectives_that_need_every_rank():
    neg = co.Negotiator(2)
    neg.join(1)
    neg.submit(0, t("rs", kind="reducescatter"), 0.0)
    neg.submit(0, t("b", kind="broadcast", root=1), 0.0)
    out = neg.decide(0.0)
    assert [r["type"] for r in out] == ["error", "error"]
    assert "joined" in out[0]["message"] and "root rank 1" in out[1]["message"]


def test_stall_warning_then_shutdown():
    neg = co.Negotiator(3, stall_check=5.0, stall_shutdown=12.0)
    neg.submit(0, t("late"), 0.0)
    neg.submit(2, t("late"), 1.0)
    assert neg.next_deadline() == 5.0
    assert neg.decide(4.0) == []
    (w,) = neg.decide(5.0)
    assert w["type"] == "stall-warning"
    assert "'late'" in w["message"] and "missing on rank 1" in w["message"]
    assert "submitted by ranks 0,2" in w["message"]
    assert neg.decide(6.0) == []  # warned again only after another period
    assert neg.next_deadline() == 10.0
    assert neg.decide(10.0)[0]["type"] == "stall-warning"
    (f,) = neg.decide(12.0)
    assert f["type"] == "fatal" and "RINGREDUCE_STALL_SHUTDOWN_SECONDS" in f["message"]


def test_no_deadline_without_pending_tensors():
    neg = co.Negotiator(2)
    assert math.isinf(neg.next_deadline())
    off = co.Negotiator(2, stall_check=0.0)
    off.submit(0, t("x"), 0.0)
    assert math.isinf(off.next_deadline()) and off.decide(1e6) == []


# ------------------------------------------------------------------- fusion
def names(plan):
    return [r["tensors"] for r in plan]


def test_fusion_packs_compatible_tensors_up_to_the_threshold():
    ts = [t(f"t{i}", 256) for i in range(5)]  # 1 KiB each
    assert names(co.plan_fusion(ts, 2048)) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert names(co.plan_fusion(ts, 1 << 20)) == [["t0", "t1", "t2", "t3", "t4"]]
    assert names(co.plan_fusion(ts, 0)) == [[f"t{i}"] for i in range(5)]


def test_fusion_keeps_large_tensors_alone_and_separates_keys():
    ts = [t("a", 10), t("big", 1 << 20), t("b", 10, dtype=F16), t("c", 10),
          t("d", 10, op=AVG), t("e", 10, prescale=0.5), t("f", 10, contributors=1),
          t("g", 10, kind="broadcast", root=0)]
    plan = names(co.plan_fusion(ts, 1 << 16))
    assert plan == [["a", "c"], ["big"], ["b"], ["d"], ["e"], ["f"], ["g"]]


def test_fusion_keeps_a_group_together_whatever_its_size():
    ts = [t(f"g.{i}", 1 << 20, group="g") for i in range(3)] + [t("x", 4)]
    assert names(co.plan_fusion(ts, 1024)) == [["g.0", "g.1", "g.2"], ["x"]]


# -------------------------------------------------------------------- cache
def test_cache_lru_eviction_and_replacement():
    c = co.ResponseCache(2)
    c.put(t("a"))
    c.put(t("b"))
    assert c.lookup(t("a")) == 0 and c.lookup(t("b")) == 1
    c.put(t("a"))  # touch: 'b' is now least recently used
    assert c.lru_order() == [1, 0]
    c.put(t("c"))  # evicts 'b', reuses its id
    assert c.lookup(t("b")) == -1 and c.lookup(t("c")) == 1
    assert c.lookup(t("a", 5)) == -1  # same name, other metadata: a miss
    c.put(t("a", 5))  # replaces 'a' in place
    assert c.lookup(t("a", 5)) == 0 and c.lookup(t("a")) == -1 and c.slots == 2


def test_cache_capacity_zero_is_off():
    c = co.ResponseCache(0)
    c.put(t("a"))
    assert c.lookup(t("a")) == -1 and c.slots == 0


def test_join_that_nobody_matches_is_reported_then_fails():
    neg = co.Negotiator(3, stall_check=5.0, stall_shutdown=12.0)
    neg.submit(1, t("x"), 0.0)
    neg.submit(2, t("x"), 0.5)
    neg.join(0, 1.0)
    assert neg.decide(1.0)[0]["type"] == "exec"  # 'x' ran with rank 0's neutral share
    assert neg.next_deadline() == 6.0  # nothing pending, nobody active since t = 1
    assert neg.decide(5.9) == []
    (w,) = neg.decide(6.0)
    assert w["type"] == "stall-warning"
    assert "join(): rank 0 joined; ranks 1,2 neither joined nor submitted anything" in w["message"]
    neg.submit(1, t("y"), 7.0)  # activity: no join warning while a tensor is pending
    neg.submit(2, t("y"), 7.0)
    assert neg.decide(7.0)[0]["tensors"] == ["y"]
    assert neg.next_deadline() == 12.0
    (f,) = neg.decide(19.0)
    assert f["type"] == "fatal" and "join()" in f["message"]
