"""Fault injection across real processes: dead peers, mismatched calls, strangers.

Under the env-var launch the survivors stay alive, so they must notice the
failure by themselves: each one has to raise a RingReduceError naming the dead
rank and the operation within DETECT_S seconds of the kill, and its next
collective must fail at once. Under mpirun, MPICH's mpiexec kills the whole job
when a rank dies; there the job must end promptly with no process left.
Nothing may be left in /dev/shm either way.

Kill points that depend on timing are drawn at random on every run (the delay
is on the worker's command line and in the victim's ``killing`` event, both in
every failure report; ``RR_FAULT_DELAY=<s>`` replays one), so repeated CI runs
hit different points: ring steps, negotiation rounds, idle engines.

The worker is tests/workers/fault_worker.py; it logs timestamped events. The
tests record how long each survivor took to raise after the kill as the
``raise_after_kill_s`` property (kept by ``--junitxml`` with ``-o junit_family=xunit1``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import pytest
from procs import (
    Job,
    env_launch_specs,
    run_env_launch,
    run_mpi,
    run_procs,
    shm_entries,
)

FAULT = "fault_worker.py"
VICTIM = 1
DETECT_S = 5.0  # a survivor must raise this soon after the kill
NEXT_S = 1.0  # ... and its next collective this soon after that
TRANSPORTS = {"shm": {}, "tcp": {"RINGREDUCE_TRANSPORT": "tcp"}, "two-hosts": {}}


def rank_env(transport: str, n: int) -> Optional[list[dict[str, str]]]:
    """``two-hosts`` (env launches only): ranks 0 and 1 share a fake host, the others
    another, so rank 0's engine waits on a shm and a TCP worker at once."""
    if transport != "two-hosts":
        return None
    return [{"RINGREDUCE_HOST_ID": "host-a" if r < 2 else "host-b"} for r in range(n)]


def random_delay(lo: float = 0.1, hi: float = 1.0) -> float:
    """Seconds until the victim dies, drawn anew each run (``RR_FAULT_DELAY`` fixes it)."""
    fixed = os.environ.get("RR_FAULT_DELAY")
    return float(fixed) if fixed else round(random.uniform(lo, hi), 3)


def launch(launcher: str, n: int, scenario: str, transport: str, sync_dir: Path,
           timeout: float = 40, linger: float = 8.0, victim: int = VICTIM,
           extra: Sequence[object] = ()) -> Job:
    args = ["--scenario", scenario, "--victim", victim, "--sync-dir", sync_dir,
            "--linger", linger, *extra]
    if scenario == "during" and "--delay" not in extra:
        args += ["--delay", random_delay(0.02, 1.0)]  # from the first negotiation on
    if launcher == "mpirun":
        return run_mpi(n, FAULT, args, env=TRANSPORTS[transport], timeout=timeout)
    return run_env_launch(n, FAULT, args, env=TRANSPORTS[transport], timeout=timeout,
                          rank_env=rank_env(transport, n))


def kill_time(job: Job, victim: int = VICTIM) -> float:
    killing = job.event(victim, "killing")
    assert killing is not None, f"the victim never got to its failure point\n{job.describe()}"
    return killing["t"]


def check_no_traces(job: Job, shm_before: set[str]) -> None:
    assert not job.timed_out, f"job hit its {job.timeout} s timeout\n{job.describe()}"
    assert not job.survivors, f"processes {job.survivors} outlived the job\n{job.describe()}"
    leftovers = job.shm_leftovers(shm_before)
    assert not leftovers, f"left in /dev/shm: {leftovers}\n{job.describe()}"


def check_survivors_noticed(job: Job, n: int, op: str = "allreduce",
                            victim: int = VICTIM) -> dict[int, float]:
    """Every survivor raised promptly, naming the victim and the operation.

    Returns how many seconds after the kill each survivor raised, by rank.
    """
    t_kill = kill_time(job, victim)
    delays = {}
    for r in range(n):
        if r == victim:
            continue
        raised, after = job.event(r, "raised"), job.event(r, "next-raised")

        def fail(what: str, r: int = r) -> str:
            return f"rank {r} (the victim is rank {victim}): {what}\n{job.describe()}"

        assert raised is not None, fail("never raised")
        assert raised["rr"], fail(f"raised {raised['cls']}, not a RingReduceError")
        assert f"rank {victim}" in raised["msg"] and op in raised["msg"], fail(
            f"the error does not name the dead rank and the operation: {raised['msg']}")
        delays[r] = delay = raised["t"] - t_kill
        assert delay < DETECT_S, fail(f"raised {delay:.2f} s after the kill")
        assert after is not None and after["rr"], fail("its next collective did not raise")
        assert after["t"] - raised["t"] < NEXT_S, fail("its next collective raised slowly")
        assert f"rank {victim}" in after["msg"], fail(
            f"its next collective's error does not name the dead rank: {after['msg']}")
        assert job.procs[r].returncode == 0, fail("exited badly")
    return delays


# ---------------------------------------------------------------- SIGKILL
@pytest.mark.parametrize("scenario, transport", [
    ("during", "shm"), ("during", "tcp"), ("idle", "shm"), ("idle", "tcp"), ("init", "shm"),
    ("init", "tcp"), ("idle", "two-hosts"),
])
def test_kill_one_rank_env_launch(scenario, transport, tmp_path, record_property):
    """(a) during 64 MB allreduces, at a random point, (b) while the others wait,
    (c) right after init.

    In (c) the survivors call their first allreduce 0.5 s after the victim died.
    """
    before = shm_entries()
    job = launch("env", 3, scenario, transport, tmp_path)
    check_no_traces(job, before)
    assert job.procs[VICTIM].returncode == -9, job.describe()
    record_property("raise_after_kill_s", check_survivors_noticed(job, 3))
    assert not job.events("linger-timeout"), job.describe()


def test_kill_during_shared_buffer_allreduce(tmp_path, record_property):
    """The survivors read the victim's memory directly (rr.shared_zeros): it stays mapped
    after the victim dies, and the phase barriers notice the death."""
    before = shm_entries()
    job = launch("env", 3, "during", "shm", tmp_path, extra=["--shared"])
    check_no_traces(job, before)
    assert job.procs[VICTIM].returncode == -9, job.describe()
    record_property("raise_after_kill_s", check_survivors_noticed(job, 3))
    assert not job.events("linger-timeout"), job.describe()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kill_during_small_blocking_calls(transport, tmp_path, record_property):
    """The callers drive their own rounds (coordination/engine_drive.cc): a loop of
    4-byte blocking allreduces, paired (engine_pair.cc: a round may be waiting for the
    victim's requests to a promise, or holding its POLL); the victim dies at a random
    point, and the survivor, whose caller or engine thread may be the one waiting,
    raises promptly naming it."""
    before = shm_entries()
    job = launch("env", 2, "during", transport, tmp_path, extra=["--elements", 1])
    check_no_traces(job, before)
    assert job.procs[VICTIM].returncode == -9, job.describe()
    record_property("raise_after_kill_s", check_survivors_noticed(job, 2))
    completed = job.event(0, "completed")
    assert completed and completed["caller_rounds"] > 0, job.describe()
    assert completed["paired"] > 0, job.describe()


# Kills at random points of the engine's life, on 3 ranks: the victim is a
# worker (rank 1; rank 2 only exchanges control messages with rank 0) or the
# coordinator itself (rank 0).
VICTIMS = pytest.mark.parametrize("victim", [1, 0], ids=["worker-dies", "coordinator-dies"])
TENSORS = 20
GAP_S = 0.02  # between the victim's submissions in the negotiation test


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@VICTIMS
def test_kill_during_negotiation(victim, transport, tmp_path, record_property):
    """Survivors wait on tensors that only the victim's submission would make ready.

    Every rank submits TENSORS named async allreduces in its own order; the
    victim submits a random number of them, one every GAP_S like a backward
    pass, and dies a random 0.1-1 s after the start: while it is still
    submitting (rounds in flight) or once it waits.
    Every survivor handle the victim never matched must raise (within
    DETECT_S of the kill, naming the victim and the tensor), the rest must
    have completed with the right values or raised too, and nothing may run
    without the victim's contribution.
    """
    before = shm_entries()
    submit = random.randint(1, TENSORS - 1)
    extra = ["--delay", random_delay(), "--tensors", TENSORS, "--submit", submit,
             "--gap", GAP_S]
    job = launch("env", 3, "negotiation", transport, tmp_path, timeout=20, victim=victim,
                 extra=extra)
    check_no_traces(job, before)
    assert job.procs[victim].returncode == -9, job.describe()
    record_property("raise_after_kill_s",
                    check_survivors_noticed(job, 3, op="allreduce", victim=victim))
    submitted = {e["name"] for e in job.events("submit").get(victim, [])}  # or about to be
    assert len(submitted) <= submit, job.describe()
    every = {f"grad.{i}" for i in range(TENSORS)}
    for r in sorted(set(range(3)) - {victim}):
        handles, raised = job.event(r, "handles"), job.event(r, "raised")
        assert handles is not None, f"rank {r} logged no outcome\n{job.describe()}"
        ok, failed = set(handles["ok"]), handles["failed"]
        assert ok | set(failed) == every and not ok & set(failed), f"rank {r}: {handles}"
        assert ok <= submitted, (
            f"rank {r}: {sorted(ok - submitted)} completed although rank "
            f"{victim} never submitted them\n{job.describe()}")
        assert raised["tensor"] not in ok, f"rank {r}: {raised}"
        for name, err in failed.items():
            assert err["rr"] and f"rank {victim}" in err["msg"] and f"'{name}'" in err["msg"], (
                f"rank {r}: the error of '{name}' does not name the dead rank and the "
                f"tensor: {err}\n{job.describe()}")
        # every pending handle failed at once, not one by one
        assert job.event(r, "next-raised")["t"] - raised["t"] < NEXT_S, job.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp", "two-hosts"])
@VICTIMS
def test_kill_while_engines_idle(victim, transport, tmp_path, record_property):
    """Nobody calls anything when the victim dies: the engines must notice by themselves.

    After a few good collectives every survivor sleeps IDLE_S with no call in
    flight; the victim dies at a random point of that (0.1-1 s in). The
    survivors' first call afterwards must raise at once, with the failure the
    engine recorded before the call was made ("stopped after an earlier
    failure"): so the engine noticed less than IDLE_S - 0.1 s after the kill,
    well within DETECT_S. (It notices through its 100 ms liveness check, or at
    once when a socket it sleeps on reports EOF or a peer's last words.)
    """
    idle = 2.0
    before = shm_entries()
    job = launch("env", 3, "engine-idle", transport, tmp_path, timeout=20, victim=victim,
                 extra=["--delay", random_delay(), "--idle", idle])
    check_no_traces(job, before)
    assert job.procs[victim].returncode == -9, job.describe()
    record_property("raise_after_kill_s",
                    check_survivors_noticed(job, 3, op="allreduce", victim=victim))
    t_kill = kill_time(job, victim)
    for r in sorted(set(range(3)) - {victim}):
        calling, raised = job.event(r, "calling"), job.event(r, "raised")
        assert calling is not None and calling["t"] - t_kill < DETECT_S, job.describe()
        assert raised["t"] - calling["t"] < NEXT_S, (
            f"rank {r}: its first call after the idle time took "
            f"{raised['t'] - calling['t']:.2f} s to raise\n{job.describe()}")
        assert "earlier failure" in raised["msg"], (
            f"rank {r}: the engine had not noticed the dead rank by itself while idle "
            f"({calling['t'] - t_kill:.2f} s after the kill): {raised['msg']}\n{job.describe()}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kill_while_engines_hold_a_batch(transport, tmp_path, record_property):
    """The engines hold their work back for a batching window far longer than the test.

    Each survivor has one async allreduce submitted and only polls it (a caller
    that waits would end the hold), under ``RINGREDUCE_BATCH_US`` and
    ``RINGREDUCE_BATCH_MAX_US`` of 60 s. The victim dies 0.1-1 s in; the held
    allreduce must still fail within DETECT_S, naming the victim and the tensor:
    the engine checks its peers between its bounded sleeps of the hold.
    """
    before = shm_entries()
    settings = {**TRANSPORTS[transport], "RINGREDUCE_BATCH_US": 60_000_000,
                "RINGREDUCE_BATCH_MAX_US": 60_000_000}
    args = ["--scenario", "held", "--victim", VICTIM, "--sync-dir", tmp_path, "--linger", 8,
            "--delay", random_delay(), "--idle", 2 * DETECT_S]
    job = run_env_launch(3, FAULT, args, env=settings, timeout=30)
    check_no_traces(job, before)
    assert job.procs[VICTIM].returncode == -9, job.describe()
    record_property("raise_after_kill_s", check_survivors_noticed(job, 3, op="'held'"))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kill_during_ring_allreduce_reaches_every_rank(transport, tmp_path, record_property):
    """In a 4-rank ring, rank 3 talks only to ranks 2 and 0; it must still learn of rank 1.

    Every survivor makes one 512 MB allreduce (slowed down by 4 KiB shm slots)
    and rank 1 dies 0.2 s into it, so all ranks are surely past the header
    exchange, where everybody hears from everybody. Regression: rank 3 once
    waited until a survivor exited; now a rank that fails tells all its peers
    (shm closed flag / socket shutdown) before raising.
    """
    args = ["--scenario", "during", "--victim", VICTIM, "--sync-dir", tmp_path, "--linger", 6,
            "--once", "--mb", 512, "--delay", 0.2]
    env = {**TRANSPORTS[transport], "RINGREDUCE_SHM_SLOT_BYTES": 4096}
    job = run_env_launch(4, FAULT, args, env=env, timeout=40)
    assert not job.timed_out, job.describe()
    record_property("raise_after_kill_s", check_survivors_noticed(job, 4))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("scenario", ["during", "idle", "init"])
def test_kill_one_rank_mpirun(scenario, transport, tmp_path):
    """mpiexec tears the job down when a rank dies: it must fail fast, leaving nothing,
    not even MPICH's own segment (the bootstrap unlinks it once every rank mapped it)."""
    before = shm_entries()
    job = launch("mpirun", 3, scenario, transport, tmp_path, timeout=30)
    check_no_traces(job, before)
    assert not job.mpich_leftovers, f"MPICH left {job.mpich_leftovers}\n{job.describe()}"
    mpirun = job.procs[0]
    assert mpirun.returncode != 0, f"mpirun succeeded although a rank died\n{job.describe()}"
    assert mpirun.ended - kill_time(job) < DETECT_S, f"mpirun lingered\n{job.describe()}"
    for r, (raised, *_) in job.events("raised").items():  # those that raised before the end
        assert raised["rr"] and f"rank {VICTIM}" in raised["msg"], f"rank {r}: {raised}"


# ------------------------------------------------------- orderly departures
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_shutdown_is_noticed(transport, tmp_path):
    """A rank calls rr.shutdown() while the others wait for it, and stays alive.

    tcp: the survivors see the socket closed; shm: they see the rank's closed
    flag. Either way PeerLostError naming the rank, within seconds.
    """
    job = launch("env", 3, "leave", transport, tmp_path)
    assert not job.timed_out, job.describe()
    check_survivors_noticed(job, 3)


@pytest.mark.parametrize("victim", [0, 1])
def test_shutdown_is_prompt_while_a_peer_is_frozen(victim, tmp_path):
    """A rank leaves (rr.shutdown()) while its call waits for a stopped peer (rank 0, the
    coordinator, or a worker): a wait inside a round is given up after shutdown's 2 s
    grace (one between rounds ends at once), not at the peer's heartbeat timeout (60 s
    here, past the test's own timeout)."""
    job = run_env_launch(3, FAULT, ["--scenario", "frozen-leave", "--victim", victim,
                                    "--sync-dir", tmp_path],
                         env={"RINGREDUCE_PEER_TIMEOUT_SECONDS": "60"}, timeout=30)
    assert not job.timed_out, job.describe()
    left = job.events("left")
    assert sorted(left) == sorted({0, 1, 2} - {victim}), job.describe()
    for r, (e, *_) in left.items():
        assert e["seconds"] < 6, (r, e)
        # its own shutdown ended the call (not a peer's last words relayed)
        assert len(e["errors"]) == 1 and e["errors"][0].startswith(f"rank {r}: "), (r, e)
        assert ("this rank is shutting down; stopped waiting to" in e["errors"][0]
                or "shut down before this collective completed" in e["errors"][0]), (r, e)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_python_exception_on_one_rank_ends_mpirun_job(transport, tmp_path):
    """The commonest failure of all: an uncaught exception on one rank under mpirun."""
    job = launch("mpirun", 3, "raise", transport, tmp_path, timeout=15)
    assert not job.timed_out, f"the job hung after rank {VICTIM} raised\n{job.describe()}"
    assert job.procs[0].returncode != 0, job.describe()
    assert job.procs[0].ended - kill_time(job) < 10, job.describe()


# --------------------------------------------------------------- mismatch
MISMATCHES = [
    ("env", "shm", (10, 11)),
    ("env", "tcp", (10, 11)),
    ("env", "shm", (16384, 16385)),  # 64 KiB: small path on rank 0, ring path on rank 1
    ("env", "tcp", (16384, 16385)),
    ("env", "shm", (200000, 200001)),
    ("mpirun", "shm", (10, 11)),
]


@pytest.mark.parametrize("launcher, transport, sizes", MISMATCHES,
                         ids=[f"{la}-{tr}-{a}vs{b}" for la, tr, (a, b) in MISMATCHES])
def test_shape_mismatch_raises_on_both_ranks_then_recovers(launcher, transport, sizes):
    run = run_mpi if launcher == "mpirun" else run_env_launch
    args = ["--scenario", "mismatch", "--sizes", ",".join(map(str, sizes))]
    job = run(2, FAULT, args, env=TRANSPORTS[transport], timeout=40)
    job.check_ok(expect_ranks=2)
    for r in range(2):
        raised = job.event(r, "raised")
        assert raised is not None, f"rank {r} did not raise\n{job.describe()}"
        assert raised["cls"] == "MismatchError", f"rank {r}: {raised}"
        for size in sizes:
            assert f"float32[{size}]" in raised["msg"], f"rank {r}: {raised['msg']}"
        assert job.event(r, "recovered") is not None, job.describe()


# --------------------------------------------------------------- stranger
def test_stranger_cannot_join(tmp_path):
    """Rank 0 of a 2-rank job, then a process with RANK=1 but another RINGREDUCE_SECRET.

    The rendezvous refuses it before it writes anything (rank 0 publishes a digest
    of the job's secret; ``_bootstrap._claim``), whatever the transport would have
    been; rank 0 then waits for its rank 1 until the connect timeout. (A stranger
    that skips the rendezvous and connects to a rank directly meets the TCP
    handshake: ``test_handshake_refuses_a_stranger``.)
    """
    connect_timeout = 5
    env = {"RINGREDUCE_CONNECT_TIMEOUT_SECONDS": connect_timeout, **TRANSPORTS["tcp"]}
    stranger = {"RINGREDUCE_SECRET": "stranger-" * 4}
    rank_env = [{"RINGREDUCE_SECRET": "member-" * 5}, stranger]
    before = shm_entries()
    specs = env_launch_specs(2, FAULT, ["--scenario", "join"], env, rank_env, tmp_path)
    job = run_procs(specs, timeout=30, log_dir=tmp_path, delays=[0, 0.5])
    check_no_traces(job, before)
    member, intruder = job.procs
    for r, proc in enumerate(job.procs):
        raised = job.event(r, "raised")
        assert raised is not None and raised["rr"], f"{proc.name} was not refused\n{job.describe()}"
        assert job.event(r, "joined") is None, job.describe()
    assert "belongs to another job" in job.event(1, "raised")["msg"], job.describe()
    slack = 3
    assert member.elapsed < connect_timeout + slack, job.describe()
    assert intruder.elapsed < connect_timeout + slack, job.describe()


def test_handshake_refuses_a_stranger(monkeypatch, capfd):
    """A process that knows a rank's endpoint but not the job's secret (it skipped the
    rendezvous) is refused by the handshake: the accepting rank logs the refusal and
    keeps waiting for its real peer (until the connect timeout); the stranger raises."""
    import threading

    import ringreduce as rr
    from ringreduce import _core

    monkeypatch.setenv("RINGREDUCE_CONNECT_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("RINGREDUCE_TRANSPORT", "tcp")
    member = _core.Context(0, 2, b"member-secret-0123456789", "host-a")
    stranger = _core.Context(1, 2, b"stranger-secret-0123456789", "host-b")
    infos = [member.local_info(), stranger.local_info()]
    errors: dict = {}

    def connect(name: str, ctx) -> None:
        try:
            ctx.connect(infos)
        except rr.RingReduceError as err:
            errors[name] = err

    threads = [threading.Thread(target=connect, args=a)
               for a in (("member", member), ("stranger", stranger))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert isinstance(errors["stranger"], rr.PeerLostError), errors
    assert isinstance(errors["member"], rr.RingReduceTimeoutError), errors
    assert "refused connection" in capfd.readouterr().err
    member.close()
    stranger.close()
