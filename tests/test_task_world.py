"""The world that Spark tasks and Ray actors form (ringreduce/_task_world.py), in one
process: rank order across hosts, the launch variables, what the driver forwards, and
which failure the driver raises. Real worlds: tests/test_spark.py, tests/test_ray.py."""

from __future__ import annotations

import os

import pytest

from ringreduce import _task_world as tw
from ringreduce.exceptions import RingReduceError


def test_rank_order_groups_hosts_in_first_seen_order():
    ws = [tw.Worker(h, f"10.0.0.{i}", 1000 + i) for i, h in enumerate("babca")]
    assert tw.rank_order(ws) == [0, 2, 1, 4, 3]
    env = [tw.world_env(ws, i, "s") for i in range(5)]
    assert [e["RANK"] for e in env] == ["0", "2", "1", "4", "3"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "0", "1", "0", "1"]
    assert [e["LOCAL_WORLD_SIZE"] for e in env] == ["2", "2", "2", "1", "2"]
    # rank 0 (worker 0) is the rendezvous for everyone
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in env} == \
        {("10.0.0.0", "1000", "5")}
    assert tw.world_env(ws, 3, "s", {"X": "1"})["X"] == "1"


def test_forwarded_env_keeps_settings_not_launch_variables():
    base = {"RINGREDUCE_TIMEOUT_SECONDS": "9", "HOROVOD_FUSION_THRESHOLD": "1",
            "RINGREDUCE_SECRET": "x", "RINGREDUCE_HOST_ID": "h", "RANK": "3", "PATH": "/bin"}
    assert tw.forwarded_env(base) == {"RINGREDUCE_TIMEOUT_SECONDS": "9",
                                      "HOROVOD_FUSION_THRESHOLD": "1"}


def test_environ_set_and_restored(monkeypatch):
    monkeypatch.setenv("RR_TW_KEEP", "old")
    monkeypatch.delenv("RR_TW_NEW", raising=False)
    saved = tw.set_environ({"RR_TW_KEEP": "new", "RR_TW_NEW": "1"})
    assert os.environ["RR_TW_KEEP"] == "new" and os.environ["RR_TW_NEW"] == "1"
    tw.restore_environ(saved)
    assert os.environ["RR_TW_KEEP"] == "old" and "RR_TW_NEW" not in os.environ


def _boom():
    raise KeyError("missing shard")


def test_returned_raises_the_root_failure_not_its_echo():
    lost = {"ok": False, "error": None, "text": "PeerLostError: rank 2 left",
            "traceback": "...", "at": 1.0, "peer_lost": True}
    root = tw.call(_boom)
    assert not root["ok"] and not root["peer_lost"] and root["at"] > lost["at"]
    with pytest.raises(KeyError, match="missing shard") as info:
        tw.returned([{"ok": True, "value": 1}, lost, root], "job")
    assert "job: rank 2 raised" in str(info.value.__cause__)
    assert "_boom" in str(info.value.__cause__)
    # only echoes: the earliest one
    with pytest.raises(RingReduceError, match="rank 1 raised PeerLostError"):
        tw.returned([{"ok": True, "value": 1}, lost, {**lost, "at": 2.0}], "job")
    assert tw.returned([{"ok": True, "value": v} for v in "ab"], "job") == ["a", "b"]


def test_driver_env(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")
    monkeypatch.setenv("RANK", "5")
    env = tw.driver_env(12, ["eth9"], {"X": 1})
    assert env["HOROVOD_CYCLE_TIME"] == "2" and "RANK" not in env
    assert env["RINGREDUCE_CONNECT_TIMEOUT_SECONDS"] == "12.0"
    assert env["RINGREDUCE_IFACE"] == "eth9" and env["X"] == "1"


def test_returned_with_ranks_not_waited_for():
    root = tw.call(_boom)
    with pytest.raises(KeyError) as info:
        tw.returned([None, root], "job")
    assert "job: rank 1 raised" in str(info.value.__cause__)
    with pytest.raises(RingReduceError, match="missing"):
        tw.returned([None, {"ok": True, "value": 1}], "job")
    with pytest.raises(KeyError, match="missing shard"):
        tw.reraise(root, "rank 4")


def test_elastic_values_take_the_last_generation():
    def rec(rank, generation, value=None, ok=True, **kw):
        return {"ok": ok, "value": value, "rank": rank, "generation": generation, **kw}

    done = [rec(0, 0, "old"), rec(1, 1, "b"), rec(0, 1, "a"), rec(None, 0, left=True)]
    assert tw.elastic_values("x", done, 0, None) == ["a", "b"]
    try:
        raise ValueError("bad batch")
    except ValueError as e:
        bad = {**tw.error_record(e), "rank": 1, "generation": 2}
    with pytest.raises(ValueError, match="bad batch") as info:  # the generation's own error
        tw.elastic_values("x", [rec(0, 2, "a"), bad], 1, "every host is blacklisted")
    assert "x: rank 1 raised" in str(info.value.__cause__)
    with pytest.raises(RingReduceError, match="ended .exit code 1.: too few workers"):
        tw.elastic_values("x", [rec(0, 0, "a")], 1, "too few workers")
    with pytest.raises(RingReduceError, match="exit code 130.: stopped by signal 2"):
        tw.elastic_values("x", [rec(0, 0, "a")], 130, None)
    with pytest.raises(RingReduceError, match="returned no values"):
        tw.elastic_values("x", [rec(1, 0, "b")], 0, None)
