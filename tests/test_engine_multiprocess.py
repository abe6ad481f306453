"""The background engine across real processes (the threaded tier's engine tests,
tests/test_engine_threaded.py, under real launchers).

Each test starts tests/workers/engine_worker.py with ``--scenario`` under
``mpirun -np 3`` (MPICH from the venv) or the env-var launch with 2 ranks (once
over forced TCP): async submissions in a different order on every rank, fused
equal to unfused, small blocking calls (folded and paired rounds), join with
uneven step counts, a shape mismatch, the stall warning and the stall
shutdown, the timeline. Every launch has a hard timeout
and leaves no process behind (tests/procs.py); the workers check their own
results, log JSON events per rank and ``OK rank r``, and a failing worker's
traceback is in the failure report.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import pytest
from procs import Job, run_env_launch, run_mpi, shm_entries

WORKER = "engine_worker.py"
TIMEOUT = 30  # per launch; every scenario takes a few seconds
TCP = {"RINGREDUCE_TRANSPORT": "tcp"}

# launcher id -> (mpirun?, ranks, extra environment)
LAUNCHERS = {
    "mpirun-np3": (True, 3, {}),
    "env-np2": (False, 2, {}),
    "env-np2-tcp": (False, 2, TCP),
}


def launch(launcher: str, scenario: str, args: tuple = (),
           env: Optional[Mapping[str, object]] = None) -> tuple[Job, int, set[str]]:
    """Run one scenario: the job, its number of ranks and /dev/shm's entries before it."""
    mpi, n, extra = LAUNCHERS[launcher]
    run = run_mpi if mpi else run_env_launch
    before = shm_entries()
    job = run(n, WORKER, ["--scenario", scenario, *args], env={**extra, **(env or {})},
              timeout=TIMEOUT)
    return job, n, before


def describe(job: Job) -> str:
    """The job's report plus the stderr files of the ranks that redirected theirs."""
    parts = [job.describe()]
    for path in sorted(job.log_dir.glob("rank*.stderr")):
        parts.append(f"--- {path.name}:\n{path.read_text()[-4000:]}")
    return "\n".join(parts)


def check_ok(job: Job, n: int, shm_before: set[str]) -> None:
    assert not job.timed_out, f"job hit its {job.timeout} s timeout\n{describe(job)}"
    bad = [p for p in job.procs if p.returncode != 0]
    assert not bad, f"{len(bad)} process(es) failed\n{describe(job)}"
    logs = job.logs()
    missing = [r for r in range(n) if f"OK rank {r}" not in logs.get(r, [])]
    assert not missing, f"ranks {missing} did not report OK\n{describe(job)}"
    assert not job.survivors, f"processes {job.survivors} outlived the job\n{describe(job)}"
    leftovers = job.shm_leftovers(shm_before)
    assert not leftovers, f"left in /dev/shm: {leftovers}\n{describe(job)}"


def the_event(job: Job, rank: int, ev: str) -> dict:
    found = job.event(rank, ev)
    assert found is not None, f"rank {rank} logged no '{ev}' event\n{describe(job)}"
    return found


def rank_list(ranks: list[int]) -> str:
    """As the engine's messages name ranks: ``rank 1`` or ``ranks 0,2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


# ---------------------------------------------------------------- timeline
def load_timeline(path: Path, job: Job) -> list[dict]:
    assert path.exists(), f"no timeline at {path}\n{describe(job)}"
    try:
        events = json.loads(path.read_text())
    except ValueError as err:
        raise AssertionError(f"{path} is not valid JSON ({err}):\n"
                             f"{path.read_text()[-2000:]}") from err
    assert isinstance(events, list) and events, f"{path}: {events!r}"
    return events


def rows(events: list[dict]) -> dict[int, str]:
    """Timeline row (tid) -> tensor name."""
    return {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}


def check_balanced(events: list[dict]) -> None:
    """Every B has its E on the same row, and time never runs backwards."""
    open_: dict[int, list[str]] = {}
    last_ts = 0
    for e in events:
        if e["ph"] == "B":
            open_.setdefault(e["tid"], []).append(e["name"])
        elif e["ph"] == "E":
            assert open_.get(e["tid"]), f"E without B on row {e['tid']}: {e}"
            open_[e["tid"]].pop()
        if "ts" in e:
            assert e["ts"] >= last_ts, f"time runs backwards at {e}"
            last_ts = e["ts"]
    still = {tid: names for tid, names in open_.items() if names}
    assert not still, f"spans never closed: {still}"


def allreduce_response_sizes(events: list[dict]) -> list[int]:
    """How many tensors each executed allreduce response carried, in order.

    Rank 0's engine executes one response at a time and opens the activity
    span (``allreduce``) on the row of each of its tensors before any of them
    ends, so the tensors whose spans open while another's is open were fused.
    A folded response (``allreduce (folded)``, engine_fold.cc) is one tensor.
    """
    sizes: list[int] = []
    open_activity: set[int] = set()
    for e in events:
        if e["ph"] == "B" and e["name"] in ("allreduce", "allreduce (folded)"):
            if open_activity:
                sizes[-1] += 1
            else:
                sizes.append(1)
            open_activity.add(e["tid"])
        elif e["ph"] == "E" and e["tid"] in open_activity:
            open_activity.discard(e["tid"])  # the activity is the innermost open span
    return sizes


# ------------------------------------------------------------------ orders
@pytest.mark.parametrize("launcher", ["mpirun-np3", "env-np2-tcp"])
def test_async_orders_exact_and_fused_equals_unfused(launcher, tmp_path):
    """~30 named tensors (1 to 1M floats) submitted async in each rank's own random
    order, two steps (the second through the response cache): exact results on
    every rank, and the same bits with fusion off (RINGREDUCE_FUSION_THRESHOLD=0).

    The timeline of each run shows that the default run did fuse and the other
    did not, so the comparison is not vacuous."""
    seed = random.randrange(1 << 30)  # a new interleaving every run; it is in the report
    digests, sizes = {}, {}
    for label, threshold in (("fused", None), ("unfused", 0)):
        timeline = tmp_path / f"{label}.json"
        env = {"RINGREDUCE_TIMELINE": timeline}
        if threshold is not None:
            env["RINGREDUCE_FUSION_THRESHOLD"] = threshold
        job, n, before = launch(launcher, "orders", ("--seed", seed), env)
        check_ok(job, n, before)
        digests[label] = {r: the_event(job, r, "results")["digest"] for r in range(n)}
        assert len(set(digests[label].values())) == 1, f"seed {seed}: {digests}"
        sizes[label] = allreduce_response_sizes(load_timeline(timeline, job))
    assert digests["fused"] == digests["unfused"], (
        f"seed {seed}: fused and unfused results differ: {digests}")
    assert max(sizes["fused"]) > 1, f"seed {seed}: nothing was fused: {sizes['fused']}"
    assert max(sizes["unfused"]) == 1, f"seed {seed}: fused with threshold 0: {sizes['unfused']}"
    assert sum(sizes["unfused"]) >= 2 * 30, sizes["unfused"]  # both steps, every tensor


# ------------------------------------------------------------- small calls
@pytest.mark.parametrize("launcher", ["mpirun-np3", "env-np2", "env-np2-tcp"])
def test_small_blocking_calls_fold_and_pair(launcher):
    """300 blocking small allreduces, barriers, broadcasts, ragged allgathers and object
    calls with ranks late in turn: every result
    right; rank 0 folds them (engine_fold.cc); a two-rank job pairs some of them
    (engine_pair.cc: no response message), a three-rank job never."""
    job, n, before = launch(launcher, "small-calls", ("--seed", random.randrange(1 << 30)))
    check_ok(job, n, before)
    counts = [the_event(job, r, "small") for r in range(n)]
    for r, c in enumerate(counts):
        assert c["folded"] > 0, f"rank {r}: nothing folded: {c}\n{describe(job)}"
        assert (c["paired"] > 0) == (n == 2), f"rank {r}: {c}\n{describe(job)}"
    assert len({c["paired"] for c in counts}) == 1, f"ranks paired differently: {counts}"


# -------------------------------------------------------------------- join
@pytest.mark.parametrize("launcher", ["mpirun-np3", "env-np2"])
def test_join_with_uneven_steps(launcher):
    """Rank r: r + 2 steps of an Average allreduce and an allgather, then join()
    (the worker checks each result against the contributing ranks only); then
    the other way round; then ordinary collectives."""
    job, n, before = launch(launcher, "join")
    check_ok(job, n, before)
    for r in range(n):
        joins = job.events("joined").get(r, [])
        assert [(j["round"], j["last"]) for j in joins] == [("first", n - 1), ("second", 0)], (
            f"rank {r}: {joins}\n{describe(job)}")
        assert joins[0]["steps"] == r + 2, joins
        the_event(job, r, "after-join")


# ---------------------------------------------------------------- mismatch
@pytest.mark.parametrize("launcher", ["mpirun-np3", "env-np2"])
def test_shape_mismatch_raises_on_every_rank_then_recovers(launcher):
    job, n, before = launch(launcher, "mismatch")
    check_ok(job, n, before)
    others = [r for r in range(n) if r != 1]
    for r in range(n):
        raised = the_event(job, r, "raised")
        msg = raised["msg"]
        assert raised["cls"] == "MismatchError", f"rank {r}: {raised}\n{describe(job)}"
        assert "'mm'" in msg, f"rank {r}: {msg}"
        assert f"{rank_list(others)} called allreduce float32[4,5] op=Sum" in msg, (
            f"rank {r}: {msg}")
        assert "rank 1 called allreduce float32[5,4] op=Sum" in msg, f"rank {r}: {msg}"
        the_event(job, r, "recovered")


# ------------------------------------------------------------------- stall
STALL_CHECK_S = 0.5
LATE_S = 1.5


@pytest.mark.parametrize("launcher", ["mpirun-np3", "env-np2-tcp"])
def test_stall_warning_on_every_rank_then_completes(launcher):
    """Rank 1 submits 'slowpoke' LATE_S after the others: every rank logs the
    stall warning naming the tensor and the missing rank (on stderr, which the
    worker sends to a file per rank), and the allreduce then completes."""
    job, n, before = launch(launcher, "stall", ("--late", LATE_S),
                    {"RINGREDUCE_STALL_CHECK_SECONDS": STALL_CHECK_S})
    check_ok(job, n, before)
    others = rank_list([r for r in range(n) if r != 1])
    want = f"'slowpoke' (allreduce) submitted by {others}, missing on rank 1"
    for r in range(n):
        path = job.log_dir / f"rank{r}.stderr"
        lines = path.read_text().splitlines() if path.exists() else []
        warnings = [ln for ln in lines if ln.startswith(f"[ringreduce WARNING rank {r}] "
                                                        "stalled tensors")]
        assert warnings, f"rank {r} logged no stall warning\n{describe(job)}"
        assert any(want in ln for ln in warnings), (
            f"rank {r}: no warning says {want!r}:\n" + "\n".join(warnings))
        the_event(job, r, "completed")
    waited = the_event(job, 0, "completed")["waited"]
    assert waited > LATE_S - 0.5, f"rank 0 completed after {waited:.2f} s although rank 1 was late"


@pytest.mark.parametrize("launcher", ["mpirun-np3", "env-np2"])
def test_stall_shutdown_raises_on_every_rank(launcher):
    """Different names on every rank never become ready: with
    RINGREDUCE_STALL_SHUTDOWN_SECONDS=1 every rank raises RingReduceTimeoutError
    within ~3 s, and its next call raises at once."""
    env = {"RINGREDUCE_STALL_SHUTDOWN_SECONDS": 1}
    job, n, before = launch(launcher, "stall-shutdown", (), env)
    check_ok(job, n, before)
    raised = {r: the_event(job, r, "raised") for r in range(n)}
    first_submit = min(e["t"] - e["took"] for e in raised.values())  # wall clock, one host
    for r in range(n):
        msg = raised[r]["msg"]
        assert raised[r]["cls"] == "RingReduceTimeoutError", (
            f"rank {r}: {raised[r]}\n{describe(job)}")
        assert raised[r]["took"] < 3.0, f"rank {r} raised {raised[r]['took']:.2f} s after its call"
        early = raised[r]["t"] - first_submit
        assert early > 0.95, f"rank {r} raised {early:.2f} s after the first submission"
        assert f"allreduce 'grad{r}'" in msg, f"rank {r}: {msg}"  # its own call
        assert "stalled tensors" in msg and "RINGREDUCE_STALL_SHUTDOWN_SECONDS=1" in msg, msg
        assert any(f"'grad{p}' (allreduce) submitted by rank {p}, missing on " in msg
                   for p in range(n)), f"rank {r}: {msg}"
        after = the_event(job, r, "next-raised")
        assert after["cls"] == "RingReduceTimeoutError", f"rank {r}: {after}"
        assert "stopped after an earlier failure" in after["msg"], f"rank {r}: {after}"
        assert after["t"] - raised[r]["t"] < 1.0, f"rank {r}: next call raised slowly"


# ---------------------------------------------------------------- timeline
def test_timeline_under_mpirun(tmp_path):
    path = tmp_path / "tl.json"
    job, n, before = launch("mpirun-np3", "timeline", ("--seed", random.randrange(1 << 30)),
                    {"RINGREDUCE_TIMELINE": path})
    check_ok(job, n, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tl.json"], "only rank 0 writes"
    events = load_timeline(path, job)
    names = {e["name"] for e in events}
    for phase in ["NEGOTIATE_ALLREDUCE", "rank 0 ready", "rank 1 ready", "rank 2 ready",
                  "WAIT", "allreduce", "RING_REDUCE_SCATTER", "RING_ALLGATHER",
                  "NEGOTIATE_ALLGATHER", "NEGOTIATE_BROADCAST"]:
        assert phase in names, f"no {phase!r} in the timeline: {sorted(names)}"
    check_balanced(events)
    row_of = {name: tid for tid, name in rows(events).items()}
    assert {f"t{i}" for i in range(6)} | {"ag", "bc"} <= set(row_of), sorted(row_of)
    for tensor in ("t0", "t2", "t4"):  # above the small size: ring phases on their rows
        mine = {e["name"] for e in events if e.get("tid") == row_of[tensor]}
        want = {"NEGOTIATE_ALLREDUCE", "rank 0 ready", "rank 1 ready", "rank 2 ready", "WAIT",
                "allreduce", "RING_REDUCE_SCATTER", "RING_ALLGATHER"}
        assert want <= mine, f"row of {tensor} lacks {sorted(want - mine)}"
