"""Elastic training (``ringrun --min-np/--max-np``, ``ringreduce.elastic``): the driver and
the framework-neutral state, with numpy workers on fake hosts (see tests/elastic_jobs.py).

Each launched job runs ``tests/workers/elastic_worker.py``, which reports the job size of
every step it kept (``sizes 3x10,2x50``): that shows both the new generation and that the
survivors went back to their last commit (every 5 steps) after a failure.
"""

from __future__ import annotations

import math
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Client
from typing import Optional

import numpy as np
import pytest
from elastic_jobs import elastic_args, generations, run_elastic
from procs import PYTHON, WORKERS

import ringreduce as rr
import ringreduce.elastic as el
from ringreduce.elastic.discovery import Discovery, FixedHosts, ScriptHosts
from ringreduce.elastic.driver import ElasticDriver, ElasticSettings
from ringreduce.elastic.hosts import Blacklist
from ringreduce.elastic.processes import ProcessSpawner
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


def test_a_lost_worker_is_replaced_and_the_new_one_gets_rank_0s_state(tmp_path):
    out_dir = tmp_path / "out"
    job = run_elastic(elastic_args(2, 3, np=2, hosts="a:1,b:1,c:1",
                                   extra=["--output-filename", str(out_dir),
                                          "-prefix-timestamp"]),
                      [*WORKER, "40", "die:w2:7"])
    assert job.procs[0].returncode == 0, job.describe()
    assert generations(job) == [["w1@a", "w2@b"], ["w1@a", "w3@c"]], job.describe()
    # w3 never ran steps 1-5: it has them only through sync() from rank 0
    assert results(job) == {"w1": (0, 2, "2x40", 1), "w3": (1, 2, "2x40", 0)}, job.describe()
    # horovodrun's output flags: a folder per worker, and the time before each line
    assert sorted(p.name for p in out_dir.iterdir()) == ["worker.1", "worker.2", "worker.3"]
    assert "RESULT w3 rank 1" in (out_dir / "worker.3" / "stdout").read_text()
    assert re.search(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[w3@c\]: RESULT w3",
                     job.procs[0].stdout, re.M), job.describe()


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


def test_a_blacklisted_host_gets_a_worker_again_after_its_cooldown():
    # w2 fails on b: b cools down 1 s while w1 trains alone (--min-np 1); then w3 starts
    # on b and joins at w1's next commit (until-size:2: w1 trains on until that happened)
    job = run_elastic(elastic_args(1, 2, np=2, hosts="a:1,b:1",
                                   extra=["--blacklist-cooldown-range", "1", "1"]),
                      [*WORKER, "20", "die:w2:7", "until-size:2"])
    assert job.procs[0].returncode == 0, job.describe()
    gens = generations(job)
    # [w1@a] alone unless b came back before w1 had rejoined (a very slow machine)
    assert gens[0] == ["w1@a", "w2@b"] and gens[-1] == ["w1@a", "w3@b"], job.describe()
    assert gens[1:-1] in ([], [["w1@a"]]), job.describe()
    err = job.procs[0].stderr
    assert "exited with code 3; blacklisting host b for 1.0 s (cooldown 1 of this host)" \
        in err, err
    back = err.index("host b's blacklist cooldown is over; it can take workers again")
    assert back < err.index("started worker w3 on b"), err
    out = results(job)
    assert sorted(out) == ["w1", "w3"] and {v[1] for v in out.values()} == {2}, job.describe()
    assert out["w1"][2] == out["w3"][2] and runs(out["w1"][2])[-1][0] == 2, out


def test_with_every_host_blacklisted_the_job_waits_for_a_cooldown():
    # w1 dies before its generation connects (no state is lost): a cools down, w2 trains
    t0 = time.monotonic()
    job = run_elastic(elastic_args(1, 1, hosts="a:1",
                                   extra=["--blacklist-cooldown-range", "1", "1"]),
                      [*WORKER, "10", "rendezvous-death:w1"])
    assert job.procs[0].returncode == 0 and time.monotonic() - t0 < 30, job.describe()
    assert generations(job) == [["w1@a"], ["w2@a"]], job.describe()
    assert "every host is blacklisted (a worker failed on each); waiting 1.0 s for host a's " \
           "cooldown" in job.procs[0].stderr, job.describe()
    assert results(job) == {"w2": (0, 1, "1x10", 0)}, job.describe()


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

    for args in (["--reset-limit", "2", "-np", "2"], ["--host-discovery-script", "true"],
                 ["--blacklist-cooldown-range", "1", "2", "-np", "2"],
                 ["--min-np", "1", "--blacklist-cooldown-range", "2", "1"],
                 ["--min-np", "1", "--blacklist-cooldown-range", "0", "1"],
                 ["--min-np", "1", "--blacklist-cooldown-range", "1"]):
        with pytest.raises(SystemExit) as info:
            main([*args, PYTHON, "-c", "pass"])
        assert info.value.code == 2


def test_blacklist_cooldowns_grow_with_each_failure_within_the_range():
    bl = Blacklist((10, 100), rand=lambda: 0.5)  # n-th period: min(100, 10 * 2**(n-1) + 5)
    assert bl.add("a", 0.0) == 15 and "a" in bl and "b" not in bl
    assert bl.add("a", 5.0) is None  # its other workers failing with it: no change
    assert bl.cooling(5.0) == {"a": 10.0} and bl.times("a") == 1
    assert bl.expire(14.9) == [] and "a" in bl
    assert bl.expire(15.0) == ["a"] and "a" not in bl and bl.cooling(15.0) == {}
    periods = []
    for now in (20.0, 100.0, 200.0, 400.0):
        periods.append(bl.add("a", now))
        assert bl.expire(now + periods[-1]) == ["a"]
    assert periods == [25, 45, 85, 100] and bl.times("a") == 5  # capped at MAX
    assert Blacklist((1, 5), rand=lambda: 0.999).period(10_000) == 5  # no overflow
    assert Blacklist((2, 2), rand=lambda: 0.999).add("b", 0.0) == 2
    assert Blacklist((2, 30), rand=lambda: 0.0).add("b", 0.0) == 2  # the first: MIN..2 MIN
    forever = Blacklist()  # no range: Horovod's default, blacklisted for good
    assert forever.add("c", 0.0) == math.inf and forever.expire(1e12) == []
    assert "c" in forever and forever.cooling(0.0) == {}
    for bad in [(0, 1), (2, 1), (-1, 5), ("x", 1), (1,), (1, math.inf)]:
        with pytest.raises(rr.InvalidInputError, match="cooldown range"):
            Blacklist(bad)  # type: ignore[arg-type]


def _spawner() -> ProcessSpawner:
    return ProcessSpawner([PYTHON, "-c", "pass"], {}, None, None, True)


def _driver(hosts: str, **settings) -> ElasticDriver:
    """A driver that starts no worker: its methods run by hand, its socket listens."""
    found = [HostSlots(h, 1) for h in hosts.split(",")] if hosts else []
    driver = ElasticDriver(_spawner(), FixedHosts(found), ElasticSettings(**settings),
                           "127.0.0.1", 1.0)
    driver.hosts = found
    return driver


def test_every_host_blacklisted_waits_for_a_cooldown_within_the_elastic_timeout(capsys):
    d = _driver("a", min_np=1, max_np=2, np=1, elastic_timeout=10, cooldown_range=(3, 60))
    d.blacklist.rand = lambda: 0.0  # periods 3, 6, 12 s
    try:
        with d.cond:  # as the driver's own loop holds it
            t = 100.0  # the driver's clock, passed by hand
            d.blacklist.add("a", t)
            d.check_hosts(t + 1)
            assert d.failure is None and "waiting 2.0 s for host a's cooldown" in \
                capsys.readouterr().err
            d.check_cooldowns(t + 3)  # usable again: like a host added by discovery
            assert "a" not in d.blacklist and d.target == 2
            assert "host a's blacklist cooldown is over" in capsys.readouterr().err
            d.blacklist.add("a", t + 4)  # its new worker failed too: 6 s, ends at t + 10
            d.check_hosts(t + 4)
            assert d.failure is None  # t + 10 is within t + 1 + 10
            d.blacklist.expire(t + 10)
            d.blacklist.add("a", t + 10.5)  # 12 s: ends past the elastic timeout
            d.check_hosts(t + 10.5)
            assert d.failure == "every host is blacklisted (a worker failed on each); the first " \
                "cooldown to end (host a's) ends in 12.0 s, past --elastic-timeout 10 s"
    finally:
        d.close()


def test_every_host_blacklisted_ends_the_job_at_once_when_waiting_cannot_help():
    for connected, cooldown in ((False, None), (True, (1.0, 1.0))):
        d = _driver("a,b", min_np=1, max_np=2, np=2, cooldown_range=cooldown)
        try:
            with d.cond:  # as the driver's own loop holds it
                d.any_connected = connected  # some generation had state: it died with it
                d.blacklist.add("a", 0.0)
                d.blacklist.add("b", 0.0)
                d.check_hosts(0.5)
                assert d.failure is not None and d.failure.startswith(
                    "every host is blacklisted (a worker failed on each)"), d.failure
                assert connected == ("no worker with the training state" in d.failure)
        finally:
            d.close()


def test_a_host_back_from_its_cooldown_makes_the_members_rejoin():
    d = _driver("a,b", min_np=1, max_np=2, np=2, cooldown_range=(1.0, 1.0))
    try:
        with d.cond:  # as the driver's own loop holds it
            d.generation, d.serial, d.formed_serial = 0, 0, 0  # a generation of one is running
            d.blacklist.add("b", 0.0)
            d.check_cooldowns(0.5)
            assert d.serial == 0 and "b" in d.blacklist
            d.check_cooldowns(1.0)
            assert d.serial == 1 and not d.removed_only and d.target == 2
            assert d.on_updates("w1", 0) == ("updates", True, False)
    finally:
        d.close()


def test_a_worker_that_cannot_be_started_blacklists_its_host(capsys):
    spawn = ProcessSpawner(["/nonexistent/ringreduce-worker"], {}, None, None, True)
    d = ElasticDriver(spawn, FixedHosts([HostSlots("localhost", 1)]),
                      ElasticSettings(1, 1, 1), "127.0.0.1", 1.0)
    try:
        with d.cond:  # as the driver's own loop holds it
            d.hosts = [HostSlots("localhost", 1)]
            d.fill()
            assert d.workers == {} and "localhost" in d.blacklist
        err = capsys.readouterr().err
        assert "cannot start worker w1 on localhost (/nonexistent/ringreduce-worker: " in err
        assert "blacklisting host localhost" in err
    finally:
        d.close()


class _SlowHosts(Discovery):
    """A discovery script that takes ``seconds`` and finds no host."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.polls = seconds, 0

    def poll(self) -> Optional[list[HostSlots]]:
        self.polls += 1
        time.sleep(self.seconds)
        return []


@contextmanager
def _running(discovery: Discovery) -> Iterator[ElasticDriver]:
    """The driver's real main loop and server in a thread (no host: no worker starts);
    stopped as by a signal."""
    d = ElasticDriver(_spawner(), discovery, ElasticSettings(1, 1, 1, discovery_interval=0.2),
                      "127.0.0.1", 1.0)
    loop = threading.Thread(target=d.run, args=(None,), daemon=True)
    loop.start()
    try:
        yield d
    finally:
        with d.cond:
            d.signum = signal.SIGTERM
        loop.join(timeout=10)
        assert not loop.is_alive()


def _connect(d: ElasticDriver):
    """A worker's authenticated connection to the driver (what ``_client.ask`` makes)."""
    return Client(("127.0.0.1", d.port), authkey=d.key.encode())


def test_a_slow_discovery_script_holds_up_no_commit():
    # the script takes 1 s; a commit's "updates" request must not wait for it (it did
    # when the script ran under the driver's lock: up to 1 s per commit)
    with _running(_SlowHosts(1.0)) as d:
        with _connect(d) as conn:
            took = []
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                t = time.monotonic()
                conn.send(("updates", "w1", 0))
                assert conn.recv() == ("updates", False, False)
                took.append(time.monotonic() - t)
                time.sleep(0.05)
        assert d.discovery.polls >= 2  # type: ignore[attr-defined]
    assert max(took) < 0.4, f"slowest answer {max(took):.2f} s over {len(took)} requests"


def test_an_idle_connection_holds_up_no_new_worker():
    # a stranger connects to ringrun's port and says nothing; a worker connecting after
    # it must still be answered (the handshake used to run on the accept thread), and the
    # stranger is hung up on once the handshake's time is up, while the worker, silent
    # for longer than that after its handshake, is still answered
    with _running(FixedHosts([])) as d:
        d.handshake_seconds = 0.5
        idle = socket.create_connection(("127.0.0.1", d.port))
        try:
            answers: list = []

            def worker() -> None:
                with _connect(d) as conn:
                    time.sleep(1.0)
                    conn.send(("updates", "w1", 0))
                    answers.append(conn.recv())

            t = threading.Thread(target=worker, daemon=True)
            t.start()
            t.join(timeout=5)
            assert answers == [("updates", False, False)], "the worker got no answer in 5 s"
            idle.settimeout(3)
            while idle.recv(4096):  # the challenge, then the end
                pass
        finally:
            idle.close()
