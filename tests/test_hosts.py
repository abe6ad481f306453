"""The host tier: ranks on real (network-namespace) hosts, and faults between them.

Every test makes its hosts with ``tests/netns.py`` (namespaces on one bridge,
torn down however the test ends) and starts ranks inside them with the
env-var launch through ``ip netns exec``; each namespace is a host of its own
through ``RINGREDUCE_HOST_ID``. The worker is tests/workers/hosts_worker.py.

* collectives across 3 hosts with the coordinator on one and two ranks sharing
  another (shm inside it, TCP across), and a call refused on one rank only;
* a link cut during traffic: every rank raises PeerLostError within the link
  timeout (TCP_USER_TIMEOUT and keepalive, RINGREDUCE_LINK_TIMEOUT_SECONDS);
* a frozen rank (SIGSTOP): every other rank names it in a warning within
  RINGREDUCE_STALL_CHECK_SECONDS and raises naming it after
  RINGREDUCE_PEER_TIMEOUT_SECONDS (the heartbeat; transport/heartbeat.h);
* two jobs started at once on one MASTER_PORT refuse each other;
* an elastic job (ringrun's driver in host 0) goes on on two hosts when the third one's
  link is cut during training.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import pytest
from elastic_jobs import GENERATION
from netns import Hosts, write_launcher
from procs import PYTHON, WORKERS, Job, _new_log_dir, base_env, run_procs

ELASTIC_WORKER = str(WORKERS / "elastic_worker.py")

WORKER = str(WORKERS / "hosts_worker.py")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def launch(hosts: Hosts, placement: Sequence[int], args: Sequence[str],
           env: Optional[dict] = None, timeout: float = 60, port: int = 29400,
           log_dir: Optional[Path] = None) -> tuple[list, Path]:
    log_dir = log_dir or _new_log_dir(None)
    base = base_env({"RINGREDUCE_CONNECT_TIMEOUT_SECONDS": 20, **(env or {})}, log_dir)
    return hosts.env_launch(placement, [PYTHON, WORKER, *args], base, port=port), log_dir


def run_during(specs: list, log_dir: Path, timeout: float, act=None) -> Job:
    """run_procs in a thread; ``act()`` runs meanwhile in this one (cut a link...)."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("job", run_procs(specs, timeout, log_dir)))
    t.start()
    try:
        if act is not None:
            act()
    finally:
        t.join()
    return box["job"]


def wait_for(job_dir: Path, ev: str, ranks: Sequence[int], timeout: float) -> bool:
    """True once every rank in ``ranks`` logged event ``ev``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = Job([], job_dir, 0).events(ev)
        if all(r in seen for r in ranks):
            return True
        time.sleep(0.05)
    return False


def test_collectives_and_a_call_refused_on_one_rank_across_hosts():
    with Hosts(2) as hosts:
        specs, log_dir = launch(hosts, [0, 1, 1], ["basic"])
        job = run_procs(specs, 60, log_dir)
    job.check_ok(expect_ranks=3)
    layout = {r: evs[0] for r, evs in job.events("layout").items()}
    assert layout[0]["cross"] == [0, 2] and layout[2]["local"] == [1, 2], job.describe()
    assert layout[1]["transports"] == {"0": "tcp", "2": "shm"}, job.describe()
    refused = job.events("refused")
    for r in (0, 2):
        by_case = {e["case"]: e for e in refused[r]}
        for case, call in (("named", "broadcast 'refused'"), ("unnamed", "allreduce")):
            e = by_case[case]
            assert e.get("cls") == "MismatchError", job.describe()
            assert "rank 1 refused this call locally" in e["msg"] and call in e["msg"], e
            assert e["after_s"] < 5, e
    assert "root_rank" in {e["case"]: e for e in refused[0]}["named"]["msg"]


def test_cut_link_raises_on_every_rank_within_the_link_timeout():
    link_timeout = 2.0
    with Hosts(3) as hosts:
        specs, log_dir = launch(hosts, [0, 1, 2], ["loop"], timeout=60, env={
            "RINGREDUCE_LINK_TIMEOUT_SECONDS": link_timeout,
            "RINGREDUCE_PEER_TIMEOUT_SECONDS": 60})
        cut_at: list[float] = []

        def cut() -> None:
            if wait_for(log_dir, "looping", range(3), 40):
                time.sleep(0.3)
                cut_at.append(time.time())
                hosts.cut(2)

        job = run_during(specs, log_dir, 60, cut)
    assert cut_at, f"the ranks never started looping\n{job.describe()}"
    raised = job.events("raised")
    assert sorted(raised) == [0, 1, 2], job.describe()
    for r, (e, *_) in raised.items():
        assert e["cls"] == "PeerLostError", job.describe()
        blamed = "rank 2" if r != 2 else "rank "
        assert blamed in e["msg"] and "allreduce 'grad'" in e["msg"], e
        # the bound: the link timeout, plus a keepalive or retransmission tick
        assert e["t"] - cut_at[0] < link_timeout + 3, (r, e["t"] - cut_at[0], e)
    assert "link is dead" in raised[0][0]["msg"] + raised[1][0]["msg"], job.describe()


def test_frozen_rank_is_named_on_every_rank_then_fails_the_job():
    stall, peer_timeout = 1.0, 4.0
    with Hosts(2) as hosts:
        specs, log_dir = launch(hosts, [0, 0, 1], ["loop", "--stop", "1"], env={
            "RINGREDUCE_STALL_CHECK_SECONDS": stall,
            "RINGREDUCE_PEER_TIMEOUT_SECONDS": peer_timeout})
        job = run_procs(specs, 60, log_dir)
    assert not job.timed_out, job.describe()
    looping = job.events("looping")
    raised = job.events("raised")
    assert sorted(raised) == [0, 2], job.describe()
    for r in (0, 2):
        e = raised[r][0]
        took = e["t"] - looping[1][0]["t"]
        # its own heartbeat verdict, or rank 0's (relayed as rank 0's last words)
        assert e["cls"] in ("RingReduceTimeoutError", "PeerLostError"), job.describe()
        assert "rank 1 (host" in e["msg"] and "no heartbeat" in e["msg"], e
        assert "while idle" not in e["msg"], e  # a loop of allreduces is no idle engine
        assert peer_timeout - 0.5 < took < peer_timeout + 3, (r, took)
        warning = [line for line in job.procs[r].stderr.splitlines()
                   if "rank 1 (host" in line and "no heartbeat" in line]
        assert warning, f"rank {r} logged no warning naming rank 1\n{job.describe()}"


def test_two_jobs_on_one_port_refuse_each_other():
    """Two jobs X and Y (2 ranks each, rank 0 on host 0) on one MASTER_PORT; X sums 1s and
    Y 100s, so a rank paired with the other job's would see 101.

    * port A, no secrets: Y starts once X has joined (X keeps the port for its lifetime):
      both of Y's ranks are refused with the explanation, X runs;
    * port B, a secret per job (as ringrun gives), both started at once: exactly one
      job runs and the other is refused (with the explanation on some rank).
    """
    hint = "two jobs on one MASTER_ADDR:MASTER_PORT"
    with Hosts(2) as hosts:
        log_dir = _new_log_dir(None)
        joined = log_dir / "x-joined"
        runs = [(29411, "X", {}, ["--hold", str(joined)]),
                (29411, "Y", {}, ["--after", str(joined)]),
                (29412, "X", {"RINGREDUCE_SECRET": "secret-of-job-X-0123456789"}, []),
                (29412, "Y", {"RINGREDUCE_SECRET": "secret-of-job-Y-0123456789"}, [])]
        specs, subs = [], {}
        for port, name, env, extra in runs:
            subs[port, name] = log_dir / f"{port}{name}"
            subs[port, name].mkdir()
            value = "1" if name == "X" else "100"
            specs += launch(hosts, [0, 1], ["job", "--value", value, *extra], env=env,
                            port=port, log_dir=subs[port, name])[0]
        job = run_procs(specs, 60, log_dir)
    assert not job.timed_out, job.describe()
    ran, hinted = set(), set()
    for (port, name), sub in subs.items():
        run = Job([], sub, 0)
        results = [run.event(r, "result") for r in (0, 1)]
        for r, res in enumerate(results):
            err = run.event(r, "raised") or run.event(r, "init-raised")
            if res is not None:  # the merge this test is about: a sum of 101
                assert res["total"] == 2 * (1 if name == "X" else 100), (port, name, r, res)
            else:
                assert err is not None and err["rr"], (port, name, r, job.describe())
                if hint in err["msg"]:
                    hinted.add((port, name, r))
        if all(results):
            ran.add((port, name))
    assert (29411, "X") in ran and {(29411, "Y", 0), (29411, "Y", 1)} <= hinted, (
        ran, hinted, job.describe())
    winners = [name for port, name in ran if port == 29412]
    assert len(winners) == 1, (ran, job.describe())
    loser = "Y" if winners[0] == "X" else "X"
    assert any((29412, loser, r) in hinted for r in (0, 1)), (hinted, job.describe())


def test_elastic_job_goes_on_when_a_hosts_link_is_cut(tmp_path):
    """ringrun runs in host 0 with workers on hosts 0-2; host 2's cable is pulled while
    they train: the others lose it within the link timeout, go back to their last commit,
    ringrun stops the unreachable worker after --elastic-timeout and forms a generation
    of two, which finishes every step."""
    progress = tmp_path / "step"
    with Hosts(3) as hosts:
        launcher = write_launcher(hosts, str(tmp_path / "launcher"))
        a = hosts.addrs
        cmd = hosts.command(0, [
            PYTHON, "-m", "ringreduce", "-np", "3", "--min-np", "2", "--max-np", "3",
            "-H", f"{a[0]}:1,{a[1]}:1,{a[2]}:1", "--ssh-command", launcher,
            "--master-addr", a[0], "--elastic-timeout", "5",
            PYTHON, ELASTIC_WORKER, "300", f"progress:{progress}"])
        env = base_env({"RINGREDUCE_LINK_TIMEOUT_SECONDS": 2,
                        "RINGREDUCE_CONNECT_TIMEOUT_SECONDS": 20,
                        "RINGREDUCE_HOST_ID": hosts.names[0]})
        cut_at: list[int] = []

        def cut() -> None:
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                step = int(progress.read_text() or 0) if progress.exists() else 0
                if step >= 12:
                    cut_at.append(step)
                    hosts.cut(2)
                    return
                time.sleep(0.02)

        job = run_during([("ringrun", cmd, env)], _new_log_dir(None), 90, cut)
    assert cut_at, f"the workers never got to step 12\n{job.describe()}"
    out, err = job.procs[0].stdout, job.procs[0].stderr
    assert job.procs[0].returncode == 0, job.describe()
    gens = [g.group(3) for g in GENERATION.finditer(err)]
    assert gens == [f"0=w1@{a[0]}, 1=w2@{a[1]}, 2=w3@{a[2]}", f"0=w1@{a[0]}, 1=w2@{a[1]}"], err
    assert f"worker w3 on {a[2]} (member) did not rejoin within --elastic-timeout 5 s" in err
    sizes = {line.split(" sizes ")[1].split()[0] for line in out.splitlines() if "RESULT" in line}
    assert len(sizes) == 1, out  # both survivors, the same history
    (big, k), (small, rest) = [tuple(map(int, r.split("x"))) for r in sizes.pop().split(",")]
    assert (big, small) == (3, 2) and k % 5 == 0 and k <= cut_at[0] + 5 and k + rest == 300
