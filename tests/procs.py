"""Launching worker processes for the multiprocess test tier, with hard timeouts.

Every process is started in a new session, and every process it creates is
tracked (by scanning /proc while the job runs), so that on timeout, failure or
normal exit nothing the test started can survive: the whole tree is SIGKILLed
in a ``finally``. MPICH's Hydra puts each rank in a session of its own, which is
why process groups alone are not enough.

Workers report through per-rank log files (``$RR_TEST_LOG_DIR/rank<r>.log``,
see ``tests/workers/common.py``): Hydra merges the ranks' stdout without
keeping lines whole, and files also survive a rank being SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

import pytest

PYTHON = sys.executable
MPIRUN = Path(sys.executable).parent / "mpirun"
WORKERS = Path(__file__).resolve().parent / "workers"
ROOT = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")

# Variables by which ringreduce (or mpi4py) would think a launcher started the
# process; scrubbed from every child's environment so each test picks its mode.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "RINGREDUCE_SECRET", "RINGREDUCE_HOST_ID",
               "RINGREDUCE_TRANSPORT", "RINGREDUCE_ELASTIC_DRIVER", "RINGREDUCE_ELASTIC_WORKER")
LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_", "I_MPI_", "MV2_",
                   "SLURM_")


# ----------------------------------------------------------------- processes
def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, ppid, start time) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def _all_processes() -> dict[int, tuple[str, int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def pid_alive(pid: int, start: Optional[int] = None) -> bool:
    """True if the process exists, is no zombie and (if given) started at ``start``."""
    st = _stat(pid)
    return st is not None and st[0] not in "ZXx" and start in (None, st[2])


class ProcessTree:
    """Every process ever seen below some roots, identified by (pid, start time)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def add_root(self, pid: int) -> None:
        st = _stat(pid)
        if st is not None:
            self.seen[pid] = st[2]

    def scan(self) -> None:
        """Add the current descendants of every process seen so far."""
        table = _all_processes()
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [p for p, start in self.seen.items() if p in table and table[p][2] == start]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in self.seen:
                    self.seen[child] = table[child][2]
                    todo.append(child)

    def alive(self) -> list[int]:
        return sorted(p for p, start in self.seen.items() if pid_alive(p, start))

    def kill_all(self, roots: Sequence[int] = (), grace: float = 1.0) -> None:
        """SIGKILL every live process seen (and its process group).

        The ``roots`` get a SIGTERM and ``grace`` seconds to wind down first:
        mpirun cleans up after itself (its temporary files) only then.
        """
        live = [p for p in roots if pid_alive(p, self.seen.get(p))]
        for pid in live:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            self.scan()
            live = [p for p in live if pid_alive(p, self.seen.get(p))]
            time.sleep(0.02)
        for _ in range(3):  # a dying parent may still fork: rescan and repeat
            self.scan()
            pids = self.alive()
            if not pids:
                return
            for pid in pids:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            time.sleep(0.05)


@dataclass
class Proc:
    """Outcome of one launched process."""

    name: str
    cmd: list[str]
    returncode: Optional[int] = None  # None: killed by us at the timeout
    stdout: str = ""
    stderr: str = ""
    started: float = 0.0  # time.time()
    ended: float = 0.0

    @property
    def elapsed(self) -> float:
        return self.ended - self.started

    def describe(self, tail: int = 6000) -> str:
        status = "TIMED OUT (killed)" if self.returncode is None else f"exit {self.returncode}"
        return (f"--- {self.name}: {status} after {self.elapsed:.1f} s: {' '.join(self.cmd)}\n"
                f"--- stdout:\n{self.stdout[-tail:]}\n--- stderr:\n{self.stderr[-tail:]}")


@dataclass
class Job:
    """A finished launch: its processes, the ranks' logs and what outlived it."""

    procs: list[Proc]
    log_dir: Path
    timeout: float
    survivors: list[int] = field(default_factory=list)  # pids alive once all procs ended
    # MPICH segments the job left in /dev/shm (run_mpi removes them, then lists them here)
    mpich_leftovers: list[str] = field(default_factory=list)

    @property
    def timed_out(self) -> bool:
        return any(p.returncode is None for p in self.procs)

    def logs(self) -> dict[int, list[str]]:
        """Lines each rank wrote to its log file, by rank."""
        out = {}
        for path in sorted(self.log_dir.glob("rank*.log")):
            out[int(path.stem[4:])] = path.read_text().splitlines()
        return out

    def events(self, ev: str) -> dict[int, list[dict]]:
        """The JSON events named ``ev`` that each rank logged, by rank."""
        out: dict[int, list[dict]] = {}
        for rank, lines in self.logs().items():
            for line in lines:
                if line.startswith("{") and json.loads(line).get("ev") == ev:
                    out.setdefault(rank, []).append(json.loads(line))
        return out

    def event(self, rank: int, ev: str) -> Optional[dict]:
        """The first ``ev`` event of ``rank``, or None."""
        found = self.events(ev).get(rank)
        return found[0] if found else None

    def shm_leftovers(self, before: set[str]) -> list[str]:
        """This job's segments still in /dev/shm that were not there ``before``.

        The job's names are known exactly from the ``job`` events (their
        prefix derives from the job secret), so segments of other jobs running
        at the same time are never blamed on this one.
        """
        prefixes = {e["shm_prefix"] for evs in self.events("job").values() for e in evs}
        return sorted(n for n in shm_entries() - before if n.startswith(tuple(prefixes)))

    def describe(self) -> str:
        parts = [p.describe() for p in self.procs]
        for rank, lines in self.logs().items():
            parts.append(f"--- log of rank {rank}:\n" + "\n".join(lines[-60:]))
        if self.survivors:
            parts.append(f"--- processes still alive after the job ended: {self.survivors}")
        return "\n".join(parts)

    def check_ok(self, expect_ranks: Optional[int] = None) -> None:
        """Assert every process exited 0 and every rank logged 'OK rank r'."""
        assert not self.timed_out, f"job hit its {self.timeout} s timeout\n{self.describe()}"
        bad = [p for p in self.procs if p.returncode != 0]
        assert not bad, f"{len(bad)} process(es) failed\n{self.describe()}"
        if expect_ranks is not None:
            logs = self.logs()
            missing = [r for r in range(expect_ranks) if f"OK rank {r}" not in logs.get(r, [])]
            assert not missing, f"ranks {missing} did not report OK\n{self.describe()}"


def run_procs(specs: Sequence[tuple[str, list[str], Mapping[str, str]]], timeout: float,
              log_dir: Path, delays: Optional[Sequence[float]] = None,
              cwd: Optional[Path] = None) -> Job:
    """Start one process per (name, cmd, env) spec and wait for all of them.

    ``delays[i]`` seconds pass before spec i starts (counted from the start of
    the previous one). The job is killed when ``timeout`` seconds have passed
    since the first start; in any case nothing it started is left running.
    The processes run in ``cwd`` (default: the repository root).
    """
    procs: list[Proc] = []
    popens = []
    files: list[tuple[IO, IO]] = []
    tree = ProcessTree()
    start = time.monotonic()
    survivors: list[int] = []
    try:
        for i, (name, cmd, env) in enumerate(specs):
            if delays and delays[i]:
                _wait(popens, procs, tree, time.monotonic() + delays[i], until_done=False)
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out, err))
            procs.append(Proc(name, list(cmd), started=time.time()))
            popens.append(subprocess.Popen(
                list(cmd), env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                cwd=str(cwd or ROOT), start_new_session=True))
            tree.add_root(popens[-1].pid)
        _wait(popens, procs, tree, start + timeout, until_done=True)
        tree.scan()
        survivors = tree.alive()
    finally:
        tree.kill_all(roots=[p.pid for p in popens if p.poll() is None])
        for proc, popen in zip(procs, popens):
            if proc.ended:  # it ended by itself
                proc.returncode = popen.wait()
            else:  # still running at the timeout (or the test failed): already killed
                popen.kill()
                popen.wait()
                proc.ended = time.time()
        for proc, (out, err) in zip(procs, files):
            for f, attr in ((out, "stdout"), (err, "stderr")):
                f.seek(0)
                setattr(proc, attr, f.read().decode(errors="replace"))
                f.close()
    return Job(procs, log_dir, timeout, survivors)


def _wait(popens: list, procs: list[Proc], tree: ProcessTree, deadline: float,
          until_done: bool) -> None:
    """Track the processes until the deadline (or until all ended, if ``until_done``)."""
    while time.monotonic() < deadline:
        tree.scan()
        for popen, proc in zip(popens, procs):
            if not proc.ended and popen.poll() is not None:
                proc.ended = time.time()
        if until_done and all(proc.ended for proc in procs):
            return
        time.sleep(0.02)


# ------------------------------------------------------------------ launches
def base_env(extra: Optional[Mapping[str, object]] = None, log_dir: Optional[Path] = None
             ) -> dict[str, str]:
    """This environment minus any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKERS), env.get("PYTHONPATH")]))
    if log_dir is not None:
        env["RR_TEST_LOG_DIR"] = str(log_dir)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_mpirun() -> Path:
    if not MPIRUN.exists():
        pytest.skip(f"mpirun not found next to the interpreter ({MPIRUN}); "
                    "pip install mpich mpi4py (or '.[test]')")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed; pip install mpi4py")
    return MPIRUN


def _script_cmd(script: str | Path, args: Sequence[object]) -> list[str]:
    path = Path(script)
    if not path.is_absolute():
        path = WORKERS / path if (WORKERS / path).exists() else ROOT / path
    return [PYTHON, str(path), *map(str, args)]


_LOG_ROOT: list[tempfile.TemporaryDirectory] = []  # removed when the interpreter exits


def _new_log_dir(log_dir: Optional[Path]) -> Path:
    if log_dir is not None:
        return Path(log_dir)
    if not _LOG_ROOT:
        _LOG_ROOT.append(tempfile.TemporaryDirectory(prefix="rr-test-logs-"))
    return Path(tempfile.mkdtemp(dir=_LOG_ROOT[0].name))


def run_mpi(np: int, script: str | Path, args: Sequence[object] = (),
            env: Optional[Mapping[str, object]] = None, timeout: float = 60,
            log_dir: Optional[Path] = None, cwd: Optional[Path] = None) -> Job:
    """``mpirun -np <np> python <script> <args>`` with a hard timeout (in ``cwd``, by default
    the repository root)."""
    mpirun = require_mpirun()
    log_dir = _new_log_dir(log_dir)
    cmd = [str(mpirun), "-np", str(np), *_script_cmd(script, args)]
    before = _mpich_segments()
    try:
        job = run_procs([("mpirun", cmd, base_env(env, log_dir))], timeout, log_dir, cwd=cwd)
    finally:
        left = _remove_orphaned_mpich_segments(before)
    job.mpich_leftovers = left
    return job


def _mpich_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("mpich_shm_*")} if SHM_DIR.is_dir() else set()


def _remove_orphaned_mpich_segments(before: set[str]) -> list[str]:
    """MPICH leaves its own /dev/shm segments behind when a rank is SIGKILLed (unless
    the ringreduce bootstrap unlinked them, as it does once every rank has mapped them).

    Removes those that appeared during the job and that no live process maps; returns
    their names.
    """
    new = _mpich_segments() - before
    if not new:
        return []
    mapped = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    maps = f.read()
            except OSError:
                continue
            mapped.update(name for name in new if name in maps)
    for name in new - mapped:
        try:
            (SHM_DIR / name).unlink()
        except FileNotFoundError:
            pass
    return sorted(new - mapped)


def env_launch_specs(n: int, script: str | Path, args: Sequence[object] = (),
                     env: Optional[Mapping[str, object]] = None,
                     rank_env: Optional[Sequence[Mapping[str, object]]] = None,
                     log_dir: Optional[Path] = None, port: Optional[int] = None,
                     ranks: Optional[Sequence[int]] = None
                     ) -> list[tuple[str, list[str], dict[str, str]]]:
    """Specs for a torchrun-style launch: RANK, WORLD_SIZE, MASTER_ADDR/PORT per process.

    ``rank_env[r]`` is added to rank r's environment; ``ranks`` picks which
    ranks to start (all by default).
    """
    port = free_port() if port is None else port
    specs = []
    for r in range(n) if ranks is None else ranks:
        launch = {"RANK": r, "WORLD_SIZE": n, "LOCAL_RANK": r, "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": port,
                  **(env or {}), **(rank_env[r] if rank_env else {})}
        specs.append((f"rank {r}", _script_cmd(script, args), base_env(launch, log_dir)))
    return specs


def run_env_launch(n: int, script: str | Path, args: Sequence[object] = (),
                   env: Optional[Mapping[str, object]] = None, timeout: float = 60,
                   rank_env: Optional[Sequence[Mapping[str, object]]] = None,
                   log_dir: Optional[Path] = None) -> Job:
    """Start ``n`` ranks with the env-var launch and wait for all of them."""
    log_dir = _new_log_dir(log_dir)
    specs = env_launch_specs(n, script, args, env, rank_env, log_dir)
    return run_procs(specs, timeout, log_dir)


def run_single(script: str | Path, args: Sequence[object] = (),
               env: Optional[Mapping[str, object]] = None, timeout: float = 60,
               log_dir: Optional[Path] = None) -> Job:
    """Run one process with no launcher at all (ringreduce falls back to size 1)."""
    log_dir = _new_log_dir(log_dir)
    return run_procs([("single", _script_cmd(script, args), base_env(env, log_dir))], timeout,
                     log_dir)


def run_python_code(code: str, env: Optional[Mapping[str, object]] = None,
                    timeout: float = 30) -> Job:
    """Run ``python -c code`` with no launcher."""
    log_dir = _new_log_dir(None)
    return run_procs([("python -c", [PYTHON, "-c", code], base_env(env, log_dir))], timeout,
                     log_dir)


# ------------------------------------------------------------- shared memory
def shm_entries() -> set[str]:
    """Names of ringreduce's shared-memory segments currently in /dev/shm."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith("ringreduce-")}
    except FileNotFoundError:
        return set()
