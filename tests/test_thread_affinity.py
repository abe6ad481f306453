"""RINGREDUCE_THREAD_AFFINITY (Horovod's HOROVOD_THREAD_AFFINITY): the engine thread of local
rank i runs on the i-th core listed; a value that is not a list of core numbers is refused at
init, naming it; a list too short for the host, or a core the process may not use, leaves the
thread unpinned with a warning, as Horovod does."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import ringreduce as rr
from ringreduce.testing import environ, make_world, run_threaded


def _engine_cores() -> list:
    """The cores the threads named rr-engine in this process may run on."""
    out = []
    for task in glob.glob("/proc/self/task/*"):
        try:
            if open(f"{task}/comm").read().strip() == "rr-engine":
                out.append(os.sched_getaffinity(int(os.path.basename(task))))
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return out


def test_thread_affinity_pins_each_local_ranks_engine_thread():
    allowed = sorted(os.sched_getaffinity(0))
    first, last = allowed[0], allowed[-1]
    before = len(_engine_cores())
    with environ({"RINGREDUCE_THREAD_AFFINITY": f"{last},{first}"}):  # Horovod's format
        comms = make_world(2)
    try:
        run_threaded(2, lambda c: c.allreduce(np.ones(2), name="x"), world=comms)
        cores = _engine_cores()
        assert len(cores) == before + 2 and {last} in cores and {first} in cores, cores
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("value, match", [
    ("x", "'x' is not a core number"),
    ("0,,1", "'' is not a core number"),
    ("0,", "'' is not a core number"),
    (" 0", "' 0' is not a core number"),
    ("99999", "'99999' is not a core number"),
    ("", None),  # unset: no pinning
])
def test_thread_affinity_refuses_what_is_not_a_core(value, match):
    with environ({"RINGREDUCE_THREAD_AFFINITY": value}):
        if match is None:
            [c.close() for c in make_world(1)]
            return
        with pytest.raises(rr.InvalidInputError, match=match):
            make_world(1)


def test_a_short_list_or_a_core_out_of_reach_leaves_the_thread_unpinned(capfd):
    allowed = os.sched_getaffinity(0)
    outside = max(allowed) + 1
    for value, says in ((str(min(allowed)), "this rank is local rank 1 of 2"),
                        (f"{outside},{outside}", f"core {outside}, which this process may not")):
        with environ({"RINGREDUCE_THREAD_AFFINITY": value}):
            comms = make_world(2)
        try:
            run_threaded(2, lambda c: c.allreduce(np.ones(2), name="x"), world=comms)
            cores = _engine_cores()
            assert allowed in cores, cores  # the unpinned one keeps the process's cores
        finally:
            for c in comms:
                c.close()
        assert says in capfd.readouterr().err
