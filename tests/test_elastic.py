"""Elastic training (``ringrun --min-np/--max-np``, ``ringreduce.elastic``): the driver and
the framework-neutral state, with numpy workers on fake hosts (see tests/elastic_jobs.py).

Each launched job runs ``tests/workers/elastic_worker.py``, which reports the job size of
every step it kept (``sizes 3x10,2x50``): that shows both the new generation and that the
survivors went back to their last commit (every 5 steps) after a failure.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from elastic_jobs import elastic_args, generations, run_elastic
from procs import PYTHON, WORKERS

import ringreduce as rr
import ringreduce.elastic as el
from ringreduce.elastic.discovery import ScriptHosts
from ringreduce.elastic.driver import ElasticDriver
from ringreduce.launcher import HostSlots

WORKER = [PYTHON, str(WORKERS / "elastic_worker.py")]
RESULT = re.compile(r"RESULT (w\d+) rank (\d+) size (\d+) sizes (\S+) resets (\d+)")

pytestmark = pytest.mark.timeout(90)


def results(job) -> dict[str, tuple[int, int, str, int]]:
    """Each finished worker's (rank, size, sizes, resets), by worker id."""
    return {m.group(1): (int(m.group(2)), int(m.group(3)), m.group(4), int(m.group(5)))
            for m in RESULT.finditer(job.procs[0].stdout)}


def runs(sizes: str) -> list[tuple[int, int]]:
    return [(int(n), int(k)) for n, k in (r.split("x") for r in sizes.split(","))]


def test_survivors_of_a_killed_worker_go_on_from_the_last_commit():
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1"),
                      [*WORKER, "60", "die:w2:12"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c"]], job.describe()
    out = results(job)
    # steps 11-12 ran at size 3 but were not committed: they ran again at size 2
    assert out == {"w1": (0, 2, "3x10,2x50", 1), "w3": (1, 2, "3x10,2x50", 1)}, job.describe()
    err = job.procs[0].stderr
    assert "worker w2 on b" in err and "exited with code 3; blacklisting host b" in err
    assert re.search(r"w1: reset 1 \(PeerLostError: .*rank 1 on host ringrun:b", err), err


def test_a_lost_worker_is_replaced_and_the_new_one_gets_rank_0s_state():
    job = run_elastic(elastic_args(2, 3, np=2, hosts="a:1,b:1,c:1"),
                      [*WORKER, "40", "die:w2:7"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b"], ["w1@a", "w3@c"]], job.describe()
    # w3 never ran steps 1-5: it has them only through sync() from rank 0
    assert results(job) == {"w1": (0, 2, "2x40", 1), "w3": (1, 2, "2x40", 0)}, job.describe()


def test_hosts_added_by_discovery_join_at_a_commit(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\n")
    job = run_elastic(elastic_args(2, 3, discovery=hosts), [*WORKER, "300", f"grow:{hosts}:6"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b"], ["w1@a", "w2@b", "w3@c"]], job.describe()
    out = results(job)
    assert sorted(out) == ["w1", "w2", "w3"] and len({v[2] for v in out.values()}) == 1, out
    (small, k), (big, rest) = runs(out["w1"][2])
    # the interrupt comes at a commit, and nothing is rolled back
    assert (small, big) == (2, 3) and k % 5 == 0 and k + rest == 300, out
    assert "hosts were added or removed" in job.procs[0].stderr


def test_new_workers_wait_for_a_commit_that_comes_after_the_elastic_timeout(tmp_path):
    # commits every 3 s, --elastic-timeout 1 s: the members must not count as stragglers
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\n")
    job = run_elastic(elastic_args(2, 3, discovery=hosts, extra=["--elastic-timeout", "1"]),
                      [*WORKER, "60", f"grow:{hosts}:2", "every:30", "sleep:0.1"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b"], ["w1@a", "w2@b", "w3@c"]], job.describe()
    assert {v[2] for v in results(job).values()} == {"2x30,3x30"}, job.describe()
    assert "stopping it" not in job.procs[0].stderr, job.describe()


def test_a_host_removed_by_discovery_leaves_at_a_commit(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\nc:1\n")
    job = run_elastic(elastic_args(2, 3, np=3, discovery=hosts),
                      [*WORKER, "300", f"shrink:{hosts}:6"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w2@b"]], job.describe()
    out = results(job)
    assert sorted(out) == ["w1", "w2"], job.describe()
    (big, k), (small, rest) = runs(out["w1"][2])
    assert (big, small) == (3, 2) and k % 5 == 0 and k + rest == 300, out
    assert "elastic worker w3 leaves the job: its host c was removed" in job.procs[0].stderr
    assert "hosts were removed" in job.procs[0].stderr  # skip_sync: nothing to sync


def test_a_frozen_worker_is_stopped_and_the_others_go_on():
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1",
                                   extra=["--elastic-timeout", "3"]),
                      [*WORKER, "60", "freeze:w2:12"], env={"RINGREDUCE_PEER_TIMEOUT_SECONDS": 2})
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c"]], job.describe()
    assert results(job) == {"w1": (0, 2, "3x10,2x50", 1), "w3": (1, 2, "3x10,2x50", 1)}
    err = job.procs[0].stderr
    assert "RingReduceTimeoutError" in err, err
    assert "worker w2 on b (member) did not rejoin within --elastic-timeout 3 s; stopping it" \
        in err, err


def test_a_removed_host_replaced_on_a_free_slot_makes_every_rank_sync(tmp_path):
    # only a removal (skip_sync), but ringrun starts a replacement on d: it syncs, so the
    # survivors must too, or the new generation's first collectives would not match
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\nc:1\nd:1\n")
    job = run_elastic(elastic_args(2, 3, np=3, discovery=hosts),
                      [*WORKER, "300", f"shrink:{hosts}:6"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w2@b", "w4@d"]], \
        job.describe()
    out = results(job)
    assert sorted(out) == ["w1", "w2", "w4"] and len({v[2] for v in out.values()}) == 1, out
    assert out["w1"][2] == "3x300", out  # size 3 throughout, nothing rolled back


def test_too_few_workers_end_the_job_after_the_elastic_timeout():
    t0 = time.monotonic()
    job = run_elastic(elastic_args(2, 2, hosts="a:1,b:1", extra=["--elastic-timeout", "3"]),
                      [*WORKER, "60", "die:w2:7"])
    assert job.procs[0].returncode == 1, job.describe()
    assert time.monotonic() - t0 < 30
    err = job.procs[0].stderr
    assert "no new generation formed within --elastic-timeout 3 s: only 1 worker(s) are " \
           "available, fewer than --min-np 2" in err, err
    assert "the driver ended the job" in err, err  # w1 was told, it did not hang


def test_the_reset_limit_ends_the_job():
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1",
                                   extra=["--reset-limit", "0"]), [*WORKER, "60", "die:w2:7"])
    assert job.procs[0].returncode == 1, job.describe()
    assert "the reset limit (0) is reached" in job.procs[0].stderr, job.describe()


def test_a_discovery_that_finds_no_host_ends_the_job_after_the_elastic_timeout(tmp_path):
    t0 = time.monotonic()
    job = run_elastic(elastic_args(1, 2, discovery=tmp_path / "missing.txt",
                                   extra=["--elastic-timeout", "2"]), [*WORKER, "10"])
    assert job.procs[0].returncode == 1 and time.monotonic() - t0 < 20, job.describe()
    err = job.procs[0].stderr
    assert "host discovery script 'cat " in err and "exited with code 1" in err, err
    assert "host discovery found no host within --elastic-timeout 2 s" in err, err


def test_a_program_that_fails_everywhere_ends_the_job_at_once():
    t0 = time.monotonic()
    job = run_elastic(elastic_args(1, 2, hosts="a:1,b:1"), [*WORKER, "10", "crash"])
    assert job.procs[0].returncode == 1 and time.monotonic() - t0 < 20, job.describe()
    assert "every host is blacklisted" in job.procs[0].stderr, job.describe()


def test_the_timeout_stops_every_worker():
    job = run_elastic(elastic_args(1, 2, np=2, hosts="a:1,b:1",
                                   extra=["--timeout", "4", "--grace-period", "1"]),
                      [*WORKER, "100000"])
    assert job.procs[0].returncode == 124, job.describe()
    assert "ringrun: timed out after 4 s; stopping the job" in job.procs[0].stderr
    assert generations(job) == [["w1@a", "w2@b"]] and not job.survivors, job.describe()


def test_a_signal_or_timeout_before_the_first_generation_starts_nobody_new():
    job = run_elastic(elastic_args(2, 2, hosts="a:1,b:1",
                                   extra=["--timeout", "1", "--grace-period", "1"]),
                      [*WORKER, "10", "late:5"])
    assert job.procs[0].returncode == 124, job.describe()
    err = job.procs[0].stderr
    assert "started worker w3" not in err and not generations(job), err
    assert not job.survivors, job.describe()


def test_a_worker_still_waiting_when_training_ends_leaves_with_0(tmp_path):
    # the job grows, but the members never commit again: w3 waits until they finish
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\n")
    job = run_elastic(elastic_args(2, 3, discovery=hosts),
                      [*WORKER, "50", f"grow:{hosts}:2", "every:1000", "sleep:0.06"])
    assert job.procs[0].returncode == 0, job.describe()
    err = job.procs[0].stderr
    assert "started worker w3 on c" in err, err
    assert "elastic worker w3 leaves the job: training finished" in err, err
    assert generations(job) == [["w1@a", "w2@b"]], job.describe()


def test_a_member_lost_in_the_rendezvous_makes_the_others_rejoin():
    job = run_elastic(elastic_args(2, 3, np=3, hosts="a:1,b:1,c:1"),
                      [*WORKER, "20", "rendezvous-death:w2"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b", "w3@c"], ["w1@a", "w3@c"]], job.describe()
    assert results(job) == {"w1": (0, 2, "2x20", 0), "w3": (1, 2, "2x20", 0)}, job.describe()
    assert "broke up during the rendezvous" in job.procs[0].stderr


def test_static_process_sets_are_refused_in_an_elastic_job(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_ELASTIC_DRIVER", "127.0.0.1:1")  # never reached
    with pytest.raises(rr.InvalidInputError, match="static process sets cannot follow"):
        rr.init(process_sets=[rr.ProcessSet([0])])
    assert not rr.is_initialized()


# ------------------------------------------------------------------ in-process
def test_discovery_script_output_and_failures(tmp_path, capsys):
    script = ScriptHosts("printf 'a:2\\nb\\n# c:9\\n\\n'", slots_per_host=4)
    assert script.poll() == [HostSlots("a", 2), HostSlots("b", 4)]
    assert ScriptHosts("echo 'a:x'").poll() is None
    assert ScriptHosts("exit 7").poll() is None
    assert "exited with code 7; keeping the last host list" in capsys.readouterr().err


def test_ranks_go_by_age_grouped_by_host():
    class W:
        def __init__(self, wid: str, age: int, host: str) -> None:
            self.wid, self.age, self.host, self.connected = wid, age, host, True

    ws = [W("w5", 5, "c"), W("w2", 2, "b"), W("w4", 4, "a"), W("w3", 3, "a")]
    assert [w.wid for w in ElasticDriver.order(ws)] == ["w2", "w3", "w4", "w5"]
    ws.append(W("w1", 1, "c"))
    assert [w.wid for w in ElasticDriver.order(ws)] == ["w1", "w5", "w2", "w3", "w4"]
    for w in ws:  # only w4 has state: it is rank 0, its host first
        w.connected = w.wid == "w4"
    assert [w.wid for w in ElasticDriver.order(ws)] == ["w4", "w3", "w1", "w5", "w2"]


def test_object_state_commit_restore_and_sync_in_one_process():
    rr.init()
    try:
        state = el.ObjectState(epoch=0, history=[1])
        state.history.append(2)
        state.commit()  # no driver: no host updates, nothing raised
        state.history.append(3)
        state.epoch = 4
        state.restore()
        assert (state.epoch, state.history) == (0, [1, 2])
        state.sync()
        assert (state.epoch, state.history) == (0, [1, 2])
    finally:
        rr.shutdown()


def test_object_state_reuses_its_saved_arrays_and_keeps_them_apart():
    rr.init()
    try:
        state = el.ObjectState(w=np.zeros(4), tag="a")
        saved = state._saved_state["w"]
        state.w += 1
        state.commit()
        assert state._saved_state["w"] is saved  # copied into, not reallocated
        state.w += 1  # in place: the commit must not see it
        state.w = state.w.astype(np.float32)  # a new dtype: copied afresh
        state.restore()
        np.testing.assert_array_equal(state.w, np.ones(4))
        assert state.w is not state._saved_state["w"] and state.w.dtype == np.float64
    finally:
        rr.shutdown()


def test_run_outside_an_elastic_job_does_not_retry():
    calls = []

    @el.run
    def train(state: el.ObjectState) -> None:
        calls.append(1)
        raise rr.PeerLostError("rank 1 left")

    rr.init()
    try:
        with pytest.raises(rr.PeerLostError):
            train(el.ObjectState())
    finally:
        rr.shutdown()
    assert calls == [1]


def test_run_retries_lost_peers_and_host_updates_but_not_program_errors(monkeypatch):
    monkeypatch.setenv("RINGREDUCE_ELASTIC_DRIVER", "127.0.0.1:1")  # never reached
    events = []

    class Recording(el.State):
        def save(self) -> None:
            events.append("save")

        def restore(self) -> None:
            events.append("restore")

        def sync(self) -> None:
            events.append("sync")

    errors = [rr.PeerLostError("lost"), rr.HostsUpdatedInterrupt(skip_sync=True),
              rr.HostsUpdatedInterrupt(), rr.MismatchError("a bug")]

    def train(state: el.State) -> None:
        events.append("train")
        raise errors.pop(0)

    def reset() -> None:  # the driver's answer: sync unless no member asked for it
        events.append("reset")
        el._client.Membership.sync = el._client.Membership.wants_sync

    wrapped = el.run_fn(train, reset)
    state = Recording()
    state.register_reset_callbacks([lambda: events.append("callback")])
    with pytest.raises(rr.MismatchError):
        wrapped(state)
    assert events == ["sync", "train", "restore", "reset", "callback", "sync", "train",
                      "reset", "callback", "train", "reset", "callback", "sync", "train"]


def test_elastic_flags_without_an_elastic_job_are_usage_errors():
    from ringreduce.launcher import main

    for args in (["--reset-limit", "2", "-np", "2"], ["--host-discovery-script", "true"]):
        with pytest.raises(SystemExit) as info:
            main([*args, PYTHON, "-c", "pass"])
        assert info.value.code == 2
