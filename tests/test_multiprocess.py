"""Multiprocess tier: real processes under mpirun, the env-var launch, or no launcher.

Every launch has a hard timeout and leaves no process behind (tests/procs.py).
The workers in tests/workers/ check their own results and log ``OK rank r``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Optional

import numpy as np
import pytest
from procs import (
    MPIRUN,
    ROOT,
    Job,
    base_env,
    free_port,
    pid_alive,
    require_mpirun,
    run_env_launch,
    run_mpi,
    run_python_code,
    run_single,
    shm_entries,
)

WORKER = "collectives_worker.py"
LIFECYCLE = "lifecycle_worker.py"
EXAMPLE = ROOT / "examples" / "numpy_train.py"


def expected_layout(hosts: Sequence[str], tcp_only: bool) -> list[dict]:
    """What each rank should report for ranks placed on ``hosts`` (hosts[r] = host of rank r)."""
    order = list(dict.fromkeys(hosts))  # hosts in order of their lowest rank
    layout = []
    for r, host in enumerate(hosts):
        local = [p for p, h in enumerate(hosts) if h == host]
        layout.append({
            "rank": r, "size": len(hosts), "local_rank": local.index(r),
            "local_size": len(local), "cross_rank": order.index(host), "cross_size": len(order),
            "transports": {str(p): "tcp" if tcp_only or hosts[p] != host else "shm"
                           for p in range(len(hosts)) if p != r},
        })
    return layout


def check_collectives(job: Job, hosts: Sequence[str], tcp_only: bool = False,
                      shm_before: Optional[set[str]] = None) -> None:
    """The worker passed on every rank, reported the right layout and left no segments."""
    job.check_ok(expect_ranks=len(hosts))
    for r, want in enumerate(expected_layout(hosts, tcp_only)):
        got = job.event(r, "layout")
        assert got is not None, f"rank {r} logged no layout\n{job.describe()}"
        got = {k: v for k, v in got.items() if k not in ("ev", "t")}
        assert got == want, f"rank {r}: layout {got} != expected {want}"
    if shm_before is not None:
        assert not job.shm_leftovers(shm_before), "shared memory left behind"


# ------------------------------------------------------------ collectives
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_collectives_mpirun(np_):
    before = shm_entries()
    job = run_mpi(np_, WORKER, timeout=120)
    check_collectives(job, ["host"] * np_, shm_before=before)


def test_collectives_mpirun_tcp():
    job = run_mpi(3, WORKER, env={"RINGREDUCE_TRANSPORT": "tcp"}, timeout=120)
    check_collectives(job, ["host"] * 3, tcp_only=True)


def test_collectives_mpirun_tiny_shm_slots():
    """Everything through the ring paths, with rings that wrap around constantly."""
    env = {"RINGREDUCE_SMALL_BYTES": 0, "RINGREDUCE_SHM_SLOT_BYTES": 4096}
    job = run_mpi(3, WORKER, ["--quick"], env=env, timeout=120)
    check_collectives(job, ["host"] * 3)


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_env_launch(n):
    """Small sizes: the large ones run the same code under mpirun above; what differs here
    is the bootstrap."""
    before = shm_entries()
    job = run_env_launch(n, WORKER, ["--quick"], timeout=120)
    check_collectives(job, ["host"] * n, shm_before=before)


@pytest.mark.parametrize("hosts, quick", [
    (("A", "A", "B", "B"), False),  # the ring crosses hosts twice: shm and tcp links
    (("A", "B", "A"), True),  # interleaved: every ring link is tcp, but 0-2 is shm
], ids=["AABB", "ABA"])
def test_collectives_fake_hosts(hosts, quick):
    """RINGREDUCE_HOST_ID splits one machine into fake hosts: shm inside, tcp across; a host
    with two ranks makes the large allreduces hierarchical (tests/test_hierarchical.py), and
    AABB also asks for the hierarchical allgather (ABA, which would qualify, is left with the
    flat ring; its staging path runs in tests/test_hierarchical.py's threads)."""
    gather = "0" if quick else "1"
    rank_env = [{"RINGREDUCE_HOST_ID": f"fake-host-{h}",
                 "RINGREDUCE_HIERARCHICAL_ALLGATHER": gather} for h in hosts]
    job = run_env_launch(len(hosts), WORKER, ["--quick"] if quick else [], rank_env=rank_env,
                         timeout=120)
    check_collectives(job, hosts)
    for r in range(len(hosts)):
        assert job.event(r, "done")["hierarchical"] > 0, job.describe()
        assert (job.event(r, "done")["hierarchical_allgathers"] > 0) == (gather == "1")


def test_collectives_single_process_without_launcher():
    job = run_single(WORKER, timeout=60)
    check_collectives(job, ["host"])


def test_env_launch_init_is_reliable():
    """A rank that is a little slow inside the rendezvous must still get through init().

    Regression: rank 0 once closed the TCP store while other ranks were still
    reading from it. Here rank 1 pauses 0.5 s between publishing its keys and
    reading the others' (RR_TEST_SLOW_STORE_READS), like a descheduled process.
    """
    env = {"RR_TEST_SLOW_STORE_READS": 0.5,
           "RINGREDUCE_CONNECT_TIMEOUT_SECONDS": 3}
    job = run_env_launch(2, "fault_worker.py", ["--scenario", "join"], env=env, timeout=30)
    for r in range(2):
        assert job.event(r, "joined") is not None, f"rank {r} failed in init\n{job.describe()}"


def test_harness_kills_hung_jobs(tmp_path):
    """procs.py itself: a job past its timeout is killed, grandchildren included."""
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                         start_new_session=True)\n"
        f"open(os.path.join({str(tmp_path)!r}, f'pid-{{os.getpid()}}-{{child.pid}}'), 'w')\n"
        "time.sleep(60)\n")
    jobs = [run_env_launch(2, script, timeout=2)]
    if MPIRUN.exists():
        jobs.append(run_mpi(2, script, timeout=3))
    for job in jobs:
        assert job.timed_out and all(p.returncode is None for p in job.procs), job.describe()
        assert all(p.elapsed < job.timeout + 2 for p in job.procs), job.describe()
    pids = [int(pid) for f in tmp_path.glob("pid-*") for pid in f.name.split("-")[1:]]
    assert len(pids) == 2 * 2 * len(jobs), sorted(tmp_path.iterdir())
    alive = [pid for pid in pids if pid_alive(pid)]
    assert not alive, f"processes {alive} survived the timeout"


# -------------------------------------------------------------- life cycle
@pytest.mark.parametrize("launcher", ["single", "mpirun", "env"])
def test_init_twice_and_reinit_after_shutdown(launcher):
    if launcher == "single":
        job = run_single(LIFECYCLE, timeout=60)
    elif launcher == "mpirun":
        job = run_mpi(2, LIFECYCLE, timeout=60)
    else:
        job = run_env_launch(2, LIFECYCLE, timeout=60)
    job.check_ok(expect_ranks=1 if launcher == "single" else 2)


def test_collective_before_init_raises_not_initialized():
    job = run_single(LIFECYCLE, ["--uninitialized-only"], timeout=60)
    job.check_ok(expect_ranks=1)
    code = ("import numpy as np, ringreduce as rr\n"
            "try:\n    rr.allreduce(np.ones(3))\n"
            "except rr.NotInitializedError as e:\n    print('raised', type(e).__name__, e)\n")
    job = run_python_code(code)
    job.check_ok()
    assert "raised NotInitializedError" in job.procs[0].stdout, job.describe()
    assert "init()" in job.procs[0].stdout, job.describe()


# ---------------------------------------------------------------- example
def final_accuracy(job: Job) -> float:
    found = re.findall(r"final test accuracy: ([0-9.]+)", job.procs[0].stdout)
    assert len(found) == 1, f"expected one accuracy line (from rank 0)\n{job.describe()}"
    return float(found[0])


def test_numpy_train_example(tmp_path):
    if not EXAMPLE.exists():
        pytest.skip(f"{EXAMPLE} does not exist yet")
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    require_mpirun()
    epochs = 15
    acc, ckpt = {}, {}
    for np_ in (1, 2):
        ckpt[np_] = tmp_path / f"np{np_}"
        job = run_mpi(np_, EXAMPLE, ["--epochs", epochs, "--checkpoint-dir", ckpt[np_]],
                      timeout=60)
        job.check_ok()
        acc[np_] = final_accuracy(job)
        files = sorted(p.name for p in ckpt[np_].iterdir())
        assert files == ["ckpt.npz"], f"-np {np_}: checkpoint dir holds {files}"
    assert min(acc.values()) >= 0.95, f"final accuracies {acc}"
    assert abs(acc[1] - acc[2]) <= 0.01, f"-np 1 and -np 2 disagree: {acc}"

    # Resuming a finished run trains no further and reports the same accuracy.
    saved = (ckpt[2] / "ckpt.npz").read_bytes()
    args = ["--epochs", epochs, "--checkpoint-dir", ckpt[2], "--resume"]
    job = run_mpi(2, EXAMPLE, args, timeout=60)
    job.check_ok()
    assert final_accuracy(job) == acc[2]
    assert (ckpt[2] / "ckpt.npz").read_bytes() == saved, "a finished run was trained further"

    # Resuming with more epochs continues from the checkpoint.
    args[1] = epochs + 2
    job = run_mpi(2, EXAMPLE, args, timeout=60)
    job.check_ok()
    assert final_accuracy(job) >= 0.95
    with np.load(ckpt[2] / "ckpt.npz") as data:
        assert int(data["epoch"]) == epochs + 2
    files = sorted(p.name for p in ckpt[2].iterdir())
    assert files == ["ckpt.npz"], f"checkpoint dir holds {files} after resuming"


def test_a_small_dev_shm_is_an_error_not_a_crash():
    """The shm links are reserved up front: in a /dev/shm too small for them (a container's
    64 MiB default against many ranks), connecting raises naming /dev/shm, where touching
    an unbacked tmpfs page used to kill the process with SIGBUS."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare as root to mount a small /dev/shm")
    code = "from ringreduce.testing import make_world; make_world(4)"
    run = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=8m tmpfs /dev/shm || exit 77; exec "$0" -c "$1"',
         sys.executable, code], capture_output=True, text=True, timeout=60)
    if run.returncode == 77:
        pytest.skip("cannot mount a tmpfs here")
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert "/dev/shm is too small" in run.stderr, run.stderr[-2000:]


_PIDNS_RANK = """
import numpy as np, ringreduce as rr
rr.init()
peer = 1 - rr.rank()
print(f"rank {rr.rank()} to {peer}: {rr._comm().transport_to(peer)} "
      f"sum {float(rr.allreduce(np.ones(2, np.float32), op=rr.Sum)[0])}", flush=True)
rr.shutdown()
"""


def test_ranks_in_different_pid_namespaces_talk_over_tcp():
    """Shared-memory links judge a local peer's death by its pid, meaningless across PID
    namespaces (containers of one pod share hostname and boot id): such ranks must count
    as different hosts. Rank 1 runs in a new PID namespace, with the same host id."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare as root for a PID namespace")
    probe = subprocess.run([unshare, "-p", "-f", "--mount-proc", "true"], capture_output=True,
                           timeout=30)
    if probe.returncode != 0:
        pytest.skip("cannot create a PID namespace here")
    port = free_port()
    procs = []
    for r in range(2):
        env = base_env({"RANK": r, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, "RINGREDUCE_HOST_ID": "one-pod"}, None)
        cmd = [sys.executable, "-c", _PIDNS_RANK]
        if r == 1:
            cmd = [unshare, "-p", "-f", "--mount-proc", *cmd]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0 to 1: tcp sum 2.0" in outs[0] and "rank 1 to 0: tcp sum 2.0" in outs[1], outs


_KEEPALIVE = """
import os, subprocess, time
from ringreduce.testing import make_world
w = make_world(2, ["host-a", "host-b"])
assert w[0].transport_to(1) == "tcp"
time.sleep(1.0)  # idle: the keepalive timer is the one armed
# A heartbeat (one small write a second) arms the retransmit timer for a moment; a
# socket passes if one of a few snapshots shows its keepalive timer.
seen = {}
for _ in range(20):
    out = subprocess.run(["ss", "-tnpo", "state", "established"], capture_output=True,
                         text=True).stdout
    for l in out.splitlines():
        if f"pid={os.getpid()}," in l:
            key = tuple(l.split()[2:4])
            if "keepalive" in l or key not in seen:
                seen[key] = l
    if seen and all("keepalive" in l for l in seen.values()):
        break
    time.sleep(0.05)
print("\\n".join(seen.values()))
for c in w:
    c.close()
"""


def test_tcp_links_probe_an_idle_peer():
    """A host that vanishes without a FIN is found by keepalive probes on every link (the
    idle liveness check alone would see 'no data' forever)."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")
    run = subprocess.run([sys.executable, "-c", _KEEPALIVE], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [x for x in run.stdout.splitlines() if x.strip()]
    assert len(lines) >= 2, run.stdout
    assert all("keepalive" in x for x in lines), run.stdout


_BLACKHOLE = """
import os, socket, time
os.environ["RINGREDUCE_CONNECT_TIMEOUT_SECONDS"] = "2"
from ringreduce import _core
lst = socket.socket()
lst.bind(("127.0.0.1", 0))
lst.listen(0)
port = lst.getsockname()[1]
fill = []
for _ in range(4):  # fill the accept queue: later SYNs are dropped, as by a firewall
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    fill.append(s)
time.sleep(0.2)
ctx = _core.Context(1, 2, b"s" * 32, "host-b")
rank0 = f"rank=0\\npid=1\\nhost=host-a\\naddr=127.0.0.1\\nport={port}\\n"
t0 = time.monotonic()
try:
    ctx.connect([rank0, ctx.local_info().decode()])
    print("connected")
except Exception as e:
    print(type(e).__name__, f"after {time.monotonic() - t0:.1f} s: {e}")
"""


def test_connecting_to_a_peer_that_drops_syns_keeps_the_deadline():
    """A peer address that never answers (SYNs dropped) fails after
    RINGREDUCE_CONNECT_TIMEOUT_SECONDS, not after the kernel's minutes of SYN retries."""
    run = subprocess.run([sys.executable, "-c", _BLACKHOLE], capture_output=True, text=True,
                         timeout=60)
    assert "RingReduceTimeoutError after 2." in run.stdout, (run.stdout, run.stderr[-1000:])
