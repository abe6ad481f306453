"""start_timeline / stop_timeline at run time (Horovod's names): rank 0 writes a strict
JSON Chrome trace of what ran between them; other ranks write nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ringreduce as rr
from ringreduce.testing import make_world, run_threaded


def names_in(path):
    events = json.loads(path.read_text())  # strict JSON once stopped
    return {e["args"]["name"] for e in events if e.get("name") == "thread_name"}


def test_start_and_stop_timeline(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"

    def fn(c):
        c.allreduce(np.ones(4), name="before")
        with rr.use_communicator(c):
            rr.start_timeline(first if c.rank() == 0 else tmp_path / f"r{c.rank()}.json")
            c.allreduce(np.ones(4), name="during")
            c.barrier()
            rr.start_timeline(str(second))  # switches files: a.json is closed
            c.allreduce(np.ones(4), name="later")
            c.barrier()
            rr.stop_timeline()
            rr.stop_timeline()  # harmless twice
        c.allreduce(np.ones(4), name="after")
        return True

    assert run_threaded(2, fn, timeout=60) == [True, True]
    assert "during" in names_in(first) and "before" not in names_in(first)
    assert "later" in names_in(second)
    assert not ({"during", "after"} & names_in(second))
    assert not (tmp_path / "r1.json").exists()


def test_start_timeline_unwritable_path_names_it(tmp_path):
    def fn(c):
        if c.rank() == 0:
            with pytest.raises(rr.InvalidInputError, match="no-such-dir"):
                c.start_timeline(tmp_path / "no-such-dir" / "t.json")
        return True

    assert run_threaded(2, fn, timeout=60) == [True, True]


def cycle_marks(path):
    return [e for e in json.loads(path.read_text()) if e.get("name") == "CYCLE_START"]


def test_mark_cycles_draws_each_negotiation_round(tmp_path):
    marked, plain = tmp_path / "marked.json", tmp_path / "plain.json"

    def fn(c):
        with rr.use_communicator(c):
            for path, mark in ((marked, True), (plain, False)):
                rr.start_timeline(path, mark_cycles=mark)
                for i in range(3):
                    c.allreduce(np.ones(4), name=f"step{i}")
                rr.stop_timeline()
        return True

    assert run_threaded(2, fn, timeout=60) == [True, True]
    marks = cycle_marks(marked)
    assert len(marks) >= 3 and all(m["ph"] == "i" and m["s"] == "g" for m in marks)
    assert [m["ts"] for m in marks] == sorted(m["ts"] for m in marks)
    assert cycle_marks(plain) == [] and "step0" in names_in(plain)


def test_mark_cycles_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("RINGREDUCE_TIMELINE", str(path))
    monkeypatch.setenv("RINGREDUCE_TIMELINE_MARK_CYCLES", "1")
    comms = make_world(2)
    monkeypatch.delenv("RINGREDUCE_TIMELINE")
    try:
        assert run_threaded(2, lambda c: c.allreduce(np.ones(2), op=rr.Sum, name="x")[0],
                            world=comms, timeout=60) == [2.0, 2.0]
    finally:
        for c in comms:
            c.close()
    assert len(cycle_marks(path)) >= 1
