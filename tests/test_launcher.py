"""The launcher: ``ringrun`` (run here as ``python -m ringreduce``) and ``ringreduce.run``.

Every launch has a hard timeout and leaves no process behind (tests/procs.py); the
ranks are tests/workers/launcher_worker.py. Remote ranks go through
tests/workers/fake_ssh.py (``--ssh-command``) or, where this process may create network
namespaces, through ``ip netns exec`` into namespaces joined by a veth pair.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest
from procs import (
    MPIRUN,
    PYTHON,
    ROOT,
    WORKERS,
    Job,
    ProcessTree,
    base_env,
    free_port,
    pid_alive,
    require_mpirun,
    run_procs,
    run_python_code,
)

import ringreduce as rr
from ringreduce import launcher

WORKER = str(WORKERS / "launcher_worker.py")
FAKE_SSH = f"{PYTHON} {WORKERS / 'fake_ssh.py'}"
RINGRUN = [PYTHON, "-m", "ringreduce"]
PID_LINE = re.compile(r"^\[(\d+)\]: pid (\d+) child (\d+)$", re.M)
# not anchored: Hydra (mpirun) does not keep the ranks' lines whole
RESULT_LINE = re.compile(r"(?:\[(\d+)\]: )?rank (\d+) size (\d+) local (\d+)/(\d+) "
                         r"cross (\d+)/(\d+) sum ([\d.]+) pid \d+")

pytestmark = pytest.mark.timeout(60)


def ringrun(args: list[str], timeout: float = 30, env: Optional[dict] = None) -> Job:
    """``ringrun ARGS`` with a hard timeout; its ranks' output is in the Job's stdout."""
    log_dir = Path(tempfile.mkdtemp(prefix="rr-launcher-"))
    return run_procs([("ringrun", [*RINGRUN, *args], base_env(env, log_dir))], timeout, log_dir)


def results(text: str) -> dict[int, dict]:
    """The ``allreduce`` worker's report of each rank, by rank."""
    out = {}
    for m in RESULT_LINE.finditer(text):
        prefix, rank, size, lr, ls, cr, cs, total = m.groups()
        assert prefix is None or prefix == rank, m.group(0)
        out[int(rank)] = {"size": int(size), "local": (int(lr), int(ls)),
                          "cross": (int(cr), int(cs)), "sum": float(total)}
    return out


def check_world(job: Job, n: int, hosts: Optional[int] = None) -> dict[int, dict]:
    proc = job.procs[0]
    assert proc.returncode == 0, job.describe()
    got = results(proc.stdout)
    assert sorted(got) == list(range(n)), job.describe()
    for r in got.values():
        assert r["size"] == n and r["sum"] == n * (n + 1) / 2, job.describe()
        if hosts is not None:
            assert r["cross"][1] == hosts, job.describe()
    return got


def rank_pids(text: str) -> dict[int, tuple[int, int]]:
    """(rank pid, pid of the rank's child) by rank, from the workers' ``pid`` lines."""
    return {int(r): (int(p), int(c)) for r, p, c in PID_LINE.findall(text)}


def assert_all_gone(pids: dict[int, tuple[int, int]], n: int, describe: str) -> None:
    assert len(pids) == n, describe
    deadline = time.monotonic() + 2  # a killed child may take a moment to be reaped
    alive = [p for pair in pids.values() for p in pair if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    assert not alive, f"processes left behind: {alive}\n{describe}"


# ----------------------------------------------------------------------- unit level
def test_parse_hosts_and_hostfile(tmp_path):
    assert launcher.parse_hosts("a:2, b ,c:1") == [
        launcher.HostSlots("a", 2), launcher.HostSlots("b", 1), launcher.HostSlots("c", 1)]
    f = tmp_path / "hosts"
    f.write_text("# cluster\nh1 slots=4\nh2:2\n\nh3  # one slot\n")
    assert launcher.parse_hostfile(f) == [
        launcher.HostSlots("h1", 4), launcher.HostSlots("h2", 2), launcher.HostSlots("h3", 1)]
    for bad in ("a:0", "a:x", ":2", ""):
        with pytest.raises(rr.InvalidInputError):
            launcher.parse_hosts(bad)


def test_plan_env_placement_and_remote_command():
    base = {"PATH": "/bin", "OMPI_COMM_WORLD_SIZE": "8", "RANK": "5", "PMI_RANK": "1",
            "RINGREDUCE_TRANSPORT": "tcp", "HOME": "/root"}
    hosts = launcher.parse_hosts("localhost:2,far:2")
    specs = launcher.plan(["python", "t.py", "a b"], 3, hosts, master_port=1234,
                          env={"X": "1"}, ssh_command="ip netns exec {host} sh -c",
                          base_env=base)
    local, remote = specs[:2], specs[2]
    assert [s.rank for s in specs] == [0, 1, 2] and not local[0].remote and remote.remote
    env0 = local[0].env
    assert "OMPI_COMM_WORLD_SIZE" not in env0 and "PMI_RANK" not in env0
    assert env0["RANK"] == "0" and env0["WORLD_SIZE"] == "3" and env0["X"] == "1"
    assert local[1].env["LOCAL_RANK"] == "1" and local[1].env["LOCAL_WORLD_SIZE"] == "2"
    assert env0["MASTER_ADDR"] == launcher.socket.gethostname()  # remote ranks need it
    assert env0["MASTER_PORT"] == "1234" and len(env0["RINGREDUCE_SECRET"]) == 64
    assert remote.argv[:5] == ["ip", "netns", "exec", "far", "sh"]
    line = remote.argv[-1]
    assert "RANK=2" in line and "LOCAL_RANK=0" in line and "LOCAL_WORLD_SIZE=1" in line
    assert "RINGREDUCE_HOST_ID=ringrun:far" in line and "RINGREDUCE_TRANSPORT=tcp" in line
    assert "OMPI_" not in line and line.endswith("python t.py 'a b'")
    ssh = launcher.plan(["x"], 1, launcher.parse_hosts("h9"), ssh_port=2222, base_env={})
    assert ssh[0].argv[:3] == ["ssh", "-p", "2222"] and ssh[0].argv[-2] == "h9"
    assert ssh[0].env["PYTHONUNBUFFERED"] == "1"
    again = launcher.plan(["x"], 1, base_env={})
    assert again[0].env["MASTER_ADDR"] == "127.0.0.1"
    assert again[0].env["RINGREDUCE_SECRET"] != launcher.plan(["x"], 1, base_env={})[0] \
        .env["RINGREDUCE_SECRET"]
    with pytest.raises(rr.InvalidInputError, match="slot"):
        launcher.plan(["x"], 5, launcher.parse_hosts("a:2,b:2"))


def test_plan_makes_openmp_threads_sleep_where_ranks_oversubscribe_a_host():
    # Several ranks of a host at torch's default thread count spin OpenMP threads on
    # each other's cores (README "Under contention"): ringrun makes them sleep instead.
    def policies(np, hosts=None, **env):
        specs = launcher.plan(["x"], np, launcher.parse_hosts(hosts) if hosts else None,
                              base_env={"PATH": "/bin", **env})
        return [s.env.get("OMP_WAIT_POLICY") if not s.remote else
                ("PASSIVE" if "OMP_WAIT_POLICY=PASSIVE" in s.argv[-1] else None)
                for s in specs]

    assert policies(2) == ["PASSIVE", "PASSIVE"]
    assert policies(1) == [None]  # one rank has the host to itself
    assert policies(2, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "ACTIVE"]  # the user's wins
    cores = len(os.sched_getaffinity(0))
    fits = None if cores >= 2 else "PASSIVE"
    assert policies(2, OMP_NUM_THREADS="1") == [fits, fits]  # a thread per rank
    assert policies(2, OMP_NUM_THREADS=str(cores)) == ["PASSIVE", "PASSIVE"]
    assert policies(3, "localhost:1,far:2") == [None, "PASSIVE", "PASSIVE"]
    assert policies(3, "localhost:1,far:2", OMP_NUM_THREADS="4") == [None, None, None]


# ------------------------------------------------------------------------- ringrun
def test_ringrun_allreduce_prefixed_output():
    job = ringrun(["-np", "2", PYTHON, WORKER, "allreduce"])
    got = check_world(job, 2, hosts=1)
    assert got[0]["local"] == (0, 2) and got[1]["local"] == (1, 2)
    out, err = job.procs[0].stdout, job.procs[0].stderr
    assert all(line.startswith(("[0]: ", "[1]: ")) for line in out.splitlines()), out
    assert "[0]: stderr of rank 0" in err and "[1]: stderr of rank 1" in err, err
    assert "stderr of rank" not in out


def test_the_ringrun_console_script():
    script = Path(PYTHON).parent / "ringrun"
    if not script.exists():
        pytest.skip("ringrun is not installed in this environment (pip install -e .)")
    log_dir = Path(tempfile.mkdtemp(prefix="rr-launcher-"))
    job = run_procs([("ringrun", [str(script), "-np", "2", PYTHON, WORKER, "allreduce"],
                      base_env(None, log_dir))], 30, log_dir)
    check_world(job, 2, hosts=1)


def test_ringrun_no_prefix_env_and_scrubbing():
    job = ringrun(["--no-prefix-output", "-np", "2", "--env", "RR_EXTRA=hi", PYTHON, WORKER,
                   "env"], env={"OMPI_COMM_WORLD_SIZE": "7", "RANK": "9"})
    out = job.procs[0].stdout
    assert job.procs[0].returncode == 0, job.describe()
    lines = sorted(x for x in out.splitlines() if x.startswith("RANK="))
    assert [x.split()[0] for x in lines] == ["RANK=0", "RANK=1"], out
    for x in lines:
        assert "WORLD_SIZE=2 " in x and "MASTER_ADDR=127.0.0.1" in x and "RR_EXTRA=hi" in x
        assert "OMPI_COMM_WORLD_SIZE=-" in x and "RINGREDUCE_HOST_ID=-" in x
    assert out.count("secret 64") == 2


def test_ringrun_failed_rank_stops_the_job():
    job = ringrun(["-np", "3", "--grace-period", "2", PYTHON, WORKER, "fail", "1", "3"])
    proc = job.procs[0]
    assert proc.returncode == 3, job.describe()
    assert proc.elapsed < 6, job.describe()
    pids = rank_pids(proc.stdout)
    assert re.search(rf"ringrun: rank 1 \(host localhost, pid {pids[1][0]}\) exited with code "
                     r"3; stopping the other 2 ranks", proc.stderr), job.describe()
    assert_all_gone(pids, 3, job.describe())
    assert not job.survivors, job.describe()


def _signal_ringrun(args: list[str], n: int, signum: int, timeout: float = 30
                    ) -> tuple[int, str, str, float, dict]:
    """Start ringrun, wait until its ``n`` ranks printed their pids, send ``signum``."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    tree = ProcessTree()
    proc = subprocess.Popen([*RINGRUN, *args], stdout=out, stderr=err, cwd=str(ROOT),
                            env=base_env(), stdin=subprocess.DEVNULL, start_new_session=True)
    tree.add_root(proc.pid)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            tree.scan()
            out.seek(0)
            if len(rank_pids(out.read().decode())) == n:
                break
            time.sleep(0.05)
        sent = time.monotonic()
        os.kill(proc.pid, signum)
        while proc.poll() is None and time.monotonic() < deadline:
            tree.scan()
            time.sleep(0.02)
        elapsed = time.monotonic() - sent
    finally:
        tree.kill_all(roots=[proc.pid] if proc.poll() is None else [])
        code = proc.wait()
    out.seek(0)
    err.seek(0)
    text, etext = out.read().decode(), err.read().decode()
    return code, text, etext, elapsed, rank_pids(text)


@pytest.mark.parametrize("mode", ["sleep", "ignore-term"])
def test_ringrun_forwards_sigterm(mode):
    code, out, err, elapsed, pids = _signal_ringrun(
        ["-np", "2", "--grace-period", "1", PYTHON, WORKER, mode], 2, signal.SIGTERM)
    describe = f"exit {code} after {elapsed:.1f} s\n{out}\n{err}"
    assert code == 128 + signal.SIGTERM, describe
    assert "ringrun: received SIGTERM; forwarding it to 2 rank(s)" in err, describe
    assert elapsed < (1.0 if mode == "sleep" else 4.0), describe  # ignored: SIGKILL after 1 s
    assert_all_gone(pids, 2, describe)


def test_ringrun_timeout():
    job = ringrun(["--timeout", "1.5", "--grace-period", "1", "-np", "2", PYTHON, WORKER,
                   "sleep"])
    proc = job.procs[0]
    assert proc.returncode == 124, job.describe()
    assert "ringrun: timed out after 1.5 s; stopping all 2 running rank(s)" in proc.stderr
    assert proc.elapsed < 6, job.describe()
    assert_all_gone(rank_pids(proc.stdout), 2, job.describe())


def test_ringrun_bad_usage():
    job = ringrun([PYTHON, WORKER, "env"])
    assert job.procs[0].returncode == 2 and "-np" in job.procs[0].stderr, job.describe()
    job = ringrun(["-np", "1", "/nonexistent/program"])
    assert job.procs[0].returncode == 127, job.describe()
    assert "cannot start rank 0" in job.procs[0].stderr, job.describe()


def test_two_jobs_on_one_master_port_never_merge():
    """Started together on one port: each job either runs alone with its own world
    (the other's rank 0 closed the store) or fails clearly; the secrets differ, so a
    rank of one job can never silently join the other."""
    port = launcher._free_port()
    args = [*RINGRUN, "-np", "2", "--master-port", str(port), "--grace-period", "1",
            "--env", "RINGREDUCE_CONNECT_TIMEOUT_SECONDS=10", PYTHON, WORKER, "allreduce"]
    log_dir = Path(tempfile.mkdtemp(prefix="rr-launcher-"))
    job = run_procs([(f"job {i}", args, base_env(None, log_dir)) for i in range(2)], 40,
                    log_dir)
    assert not job.timed_out, job.describe()
    for proc in job.procs:
        if proc.returncode == 0:
            got = results(proc.stdout)
            assert sorted(got) == [0, 1], job.describe()
            assert all(r["size"] == 2 and r["sum"] == 3 for r in got.values()), job.describe()
        else:
            assert re.search(r"ringrun: rank \d \(host localhost, pid \d+\) exited with code",
                             proc.stderr), job.describe()
    assert not job.survivors, job.describe()


def test_ringrun_remote_ranks_through_ssh_command(tmp_path):
    log = tmp_path / "ssh.log"
    job = ringrun(["-H", "fakehost1:1,fakehost2:2", "--master-addr", "127.0.0.1",
                   "--ssh-command", FAKE_SSH, "--ssh-port", "2222", PYTHON, WORKER,
                   "allreduce"], env={"RR_FAKE_SSH_LOG": str(log)})
    got = check_world(job, 3, hosts=2)
    assert got[0]["local"] == (0, 1) and got[2]["local"] == (1, 2)
    assert got[0]["cross"] == (0, 2) and got[1]["cross"] == (1, 2)
    assert sorted(log.read_text().split()) == ["fakehost1", "fakehost2", "fakehost2"]


def test_ringrun_hostfile_mixing_local_and_remote(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nfakehost:1\n")
    job = ringrun(["--hostfile", str(hostfile), "--master-addr", "127.0.0.1",
                   "--ssh-command", FAKE_SSH, PYTHON, WORKER, "allreduce"])
    check_world(job, 2, hosts=2)


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair: (name, address) of each."""
    if not shutil.which("ip"):
        pytest.skip("iproute2 (ip) is not installed")
    tag = uuid.uuid4().hex[:6]
    names, veths = [f"rr-{tag}-a", f"rr-{tag}-b"], [f"rrv{tag}a", f"rrv{tag}b"]
    net = 10 + int(tag[:2], 16) % 200
    addrs = [f"10.231.{net}.1", f"10.231.{net}.2"]

    def ip(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)

    made = []
    try:
        for name in names:
            res = ip("netns", "add", name)
            if res.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {res.stderr.strip()}")
            made.append(name)
        steps = [("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])]
        for name, veth, addr in zip(names, veths, addrs):
            steps += [("link", "set", veth, "netns", name),
                      ("-n", name, "addr", "add", f"{addr}/24", "dev", veth),
                      ("-n", name, "link", "set", veth, "up"),
                      ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            res = ip(*step)
            if res.returncode != 0:
                pytest.skip(f"cannot set up a veth pair: ip {' '.join(step)}: {res.stderr}")
        yield list(zip(names, addrs))
    finally:
        for name in made:
            ip("netns", "del", name)  # takes its end of the veth pair (and so both) along


def test_ringrun_across_network_namespaces(two_namespaces):
    (ns_a, addr_a), (ns_b, _) = two_namespaces
    job = ringrun(["-H", f"{ns_a}:2,{ns_b}:1", "--master-addr", addr_a,
                   "--ssh-command", "ip netns exec {host} sh -c", PYTHON, WORKER, "allreduce"])
    got = check_world(job, 3, hosts=2)
    assert got[2]["cross"] == (1, 2) and got[1]["local"] == (1, 2)


# --------------------------------------------------------------------- ringreduce.run
def _rank_value(offset: int) -> tuple[int, int, float]:
    import numpy as np

    import ringreduce as rr

    rr.init()
    try:
        total = rr.allreduce(np.array([1.0]), op=rr.Sum, name="one")[0]
        return rr.rank() + offset, rr.size(), float(total)
    finally:
        rr.shutdown()


def _said_and_settings() -> tuple:
    import ringreduce as rr

    rr.init()
    try:
        print(f"hello from {rr.rank()}", flush=True)
        return (os.environ.get("RINGREDUCE_CONNECT_TIMEOUT_SECONDS"),
                os.environ.get("RINGREDUCE_IFACE"))
    finally:
        rr.shutdown()


def _fail_on_rank_1() -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    time.sleep(60)
    return rank


def test_run_returns_each_ranks_value():
    assert rr.run(_rank_value, args=(10,), np=2, timeout=30) == [(10, 2, 2.0), (11, 2, 2.0)]
    # No np, num_proc, hosts or hostfile: one rank, as horovod.run's num_proc=1.
    assert rr.run(_rank_value, args=(10,), timeout=30) == [(10, 1, 1.0)]


def test_run_takes_horovods_arguments(tmp_path):
    # Horovod's examples call horovod.run(train, np=..., hosts=..., use_gloo=..., use_mpi=...,
    # verbose=2); num_proc, hostfile and executable are its other names that mean something.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    assert rr.run(_rank_value, args=(10,), num_proc=2, hostfile=str(hostfile), use_gloo=True,
                  use_mpi=False, verbose=2, executable=PYTHON, timeout=30) \
        == [(10, 2, 2.0), (11, 2, 2.0)]
    for kwargs, match in [({"use_gloo": True, "use_mpi": True}, "use_gloo and use_mpi"),
                          ({"np": 2, "num_proc": 3}, "differ"),
                          ({"hosts": "localhost:2", "hostfile": str(hostfile)}, "not both"),
                          ({"mpi_args": "-v"}, "mpi_args not supported"),
                          ({"min_np": 1, "cooldown_range": (2, 1)}, "0 < MIN <= MAX")]:
        with pytest.raises(rr.InvalidInputError, match=match):
            rr.run(_rank_value, args=(0,), **kwargs)
    with pytest.raises(TypeError, match="'bogus'"):
        rr.run(_rank_value, args=(0,), bogus=1)


def test_run_takes_horovods_output_and_network_arguments(tmp_path, capfd):
    got = rr.run(_said_and_settings, np=2, start_timeout=45, network_interface="lo",
                 output_filename=str(tmp_path / "out"), verbose=2, timeout=30)
    assert got == [("45.0", "lo")] * 2
    for r in (0, 1):
        assert (tmp_path / "out" / f"rank.{r}" / "stdout").read_text() == f"hello from {r}\n"
    assert "ringrun: rank 1 started on localhost" in capfd.readouterr().err


def _elastic_sizes(steps: int, die: str) -> tuple[int, int, list]:
    import os

    import numpy as np

    import ringreduce as rr

    rr.init()
    state = rr.elastic.ObjectState(sizes=[])

    @rr.elastic.run
    def train(state: rr.elastic.ObjectState) -> None:
        while len(state.sizes) < steps:
            state.sizes.append(int(rr.allreduce(np.ones(1), op=rr.Sum, name="n")[0]))
            if os.environ["RINGREDUCE_ELASTIC_WORKER"] == die and len(state.sizes) == 7:
                os._exit(5)
            if len(state.sizes) % 5 == 0:
                state.commit()

    train(state)
    return rr.rank(), rr.size(), state.sizes


def test_run_with_horovods_elastic_arguments():
    # two names of this machine are two hosts to the driver: w1 (rank 0) dies, its host
    # is blacklisted (cooldown_range is taken; its 30 s outlast the job), and the job goes
    # on with the two workers of the other
    values = rr.run(_elastic_sizes, args=(12, "w1"), hosts="localhost:1,127.0.0.1:2", np=3,
                    min_num_proc=2, max_num_proc=3, elastic_timeout=20, timeout=60,
                    cooldown_range=(30, 60))
    assert values == [(0, 2, [3] * 5 + [2] * 7), (1, 2, [3] * 5 + [2] * 7)]


def test_run_reraises_a_ranks_exception():
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        rr.run(_fail_on_rank_1, np=2, timeout=30)
    assert time.monotonic() - start < 15
    cause = str(info.value.__cause__)
    assert "rank 1 raised" in cause and "Traceback" in cause and "_fail_on_rank_1" in cause


def test_run_function_of_an_interactive_main():
    """A function typed into a notebook (here ``python -c``) has no script to be imported
    from: it travels by value (cloudpickle), and its closure with it."""
    code = ("import numpy as np\n"
            "import ringreduce as rr\n"
            "scale = 3\n"
            "def fn():\n"
            "    rr.init()\n"
            "    return rr.allreduce(np.array([rr.rank() + 1.0]) * scale, op=rr.Sum).tolist()\n"
            "print('VALUES', rr.run(fn, np=2, timeout=60))\n")
    job = run_python_code(code, timeout=90)
    out = job.procs[0].stdout
    assert "VALUES [[9.0], [9.0]]" in out, job.describe()


def test_run_timeout():
    with pytest.raises(rr.RingReduceTimeoutError, match="timed out"):
        rr.run(time.sleep, args=(60,), np=2, timeout=1)


# -------------------------------------------------------------------- mpirun host list
@pytest.mark.parametrize("hosts", [["-hosts", "localhost,localhost"],
                                   ["-host", "localhost", "-ppn", "2"]])
def test_mpirun_with_a_host_list(hosts):
    require_mpirun()
    log_dir = Path(tempfile.mkdtemp(prefix="rr-launcher-"))
    cmd = [str(MPIRUN), *hosts, "-np", "2", PYTHON, WORKER, "allreduce"]
    job = run_procs([("mpirun", cmd, base_env(None, log_dir))], 60, log_dir)
    check_world(job, 2, hosts=1)


# ------------------------------------------------------------------------- TF_CONFIG
def _tf_config(kind: str, index: int, chief: bool = True, ports=(1, 2, 3)) -> str:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[1:]], "ps": ["127.0.0.1:9"]}
    if chief:
        cluster["chief"] = [f"127.0.0.1:{ports[0]}"]
    else:
        cluster["worker"].insert(0, f"127.0.0.1:{ports[0]}")
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def test_tf_config_ranks_chief_first_then_workers():
    from ringreduce._bootstrap import tf_config_launch

    assert tf_config_launch(_tf_config("chief", 0)) == {
        "RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert tf_config_launch(_tf_config("worker", 1))["RANK"] == "2"
    assert tf_config_launch(_tf_config("worker", 0, chief=False))["RANK"] == "0"
    spec = {"cluster": {"worker": ["[::1]:2222"]}, "task": {"type": "worker", "index": 0}}
    assert tf_config_launch(json.dumps(spec))["MASTER_ADDR"] == "::1"
    for bad, match in [(_tf_config("ps", 0), "ps:0 has no place"),
                       (_tf_config("evaluator", 0), "evaluator:0 has no place"),
                       (_tf_config("worker", 5), "worker:5 is not in the cluster spec"),
                       ('{"cluster": {}}', "not a cluster spec with a task"),
                       ("not json", "not a cluster spec"),
                       (json.dumps({"cluster": {"worker": ["nohost"]},
                                    "task": {"type": "worker"}}), "not host:port")]:
        with pytest.raises(rr.InvalidInputError, match=match):
            tf_config_launch(bad)


def test_tf_config_launch_across_processes(tmp_path):
    """Three processes started as a TFJob starts them, with only TF_CONFIG: the chief is
    rank 0 and serves the rendezvous on its TF_CONFIG port."""
    ports = [free_port() for _ in range(3)]
    roles = [("chief", 0), ("worker", 0), ("worker", 1)]
    specs = [(f"{k}:{i}", [PYTHON, WORKER, "allreduce"],
              base_env({"TF_CONFIG": _tf_config(k, i, ports=ports)}, tmp_path))
             for k, i in roles]
    job = run_procs(specs, 60, tmp_path)
    got = {}
    for proc in job.procs:
        assert proc.returncode == 0, job.describe()
        got.update(results(proc.stdout))
    assert sorted(got) == [0, 1, 2] and {r["sum"] for r in got.values()} == {6.0}
    assert "rank 0 " in job.procs[0].stdout and "rank 2 " in job.procs[2].stdout
