"""``ringrun`` and ``ringreduce.run``: start the ranks of a job with the env-var launch.

In the spirit of ``horovodrun`` / ``horovod.run`` and ``torchrun``, and no more: the
launcher starts ``-np`` ranks (locally, or on other hosts over ``ssh``), gives each the
torchrun-style variables that ``ringreduce.init()`` reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus a fresh
``RINGREDUCE_SECRET``, prefixes their output with the rank, forwards signals and stops
the whole job when one rank fails. It is not a cluster manager: on clusters use
``mpirun`` with a host list or ``srun``. ::

    ringrun -np 4 python train.py
    ringrun -H host1:2,host2:2 python train.py
    python -m ringreduce -np 2 python train.py     # the same without the console script
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Optional

from . import _horovodrun
from ._horovod_settings import elastic_timeout
from .exceptions import InvalidInputError

__all__ = ["HostSlots", "launch", "main", "parse_hostfile", "parse_hosts"]

# What a rank inherits from the launcher's own launcher (mpirun, srun, torchrun, an outer
# ringrun) would make ringreduce (or mpi4py) join the wrong job: scrubbed from every rank.
SCRUBBED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "RINGREDUCE_SECRET", "RINGREDUCE_HOST_ID", "GROUP_RANK",
                 "ROLE_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEPID",
                 "SLURM_STEP_ID", "RINGREDUCE_ELASTIC_DRIVER", "RINGREDUCE_ELASTIC_WORKER")
SCRUBBED_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_", "I_MPI_", "MV2_",
                     "TORCHELASTIC_")
DEFAULT_SSH = ("ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no")
DEFAULT_GRACE_SECONDS = 5.0
TIMEOUT_EXIT_CODE = 124


# --------------------------------------------------------------------------- hosts
@dataclass(frozen=True)
class HostSlots:
    """One host entry: where to start ranks and how many at most."""

    host: str
    slots: int = 1


def parse_hosts(spec: str) -> list[HostSlots]:
    """Parse ``-H host1:2,host2:2`` (``host`` alone means one slot).

    Parameters
    ----------
    spec : str
        Comma-separated ``host[:slots]`` entries.

    Returns
    -------
    list of HostSlots
        The entries in order; ranks fill them in this order.
    """
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        host, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        out.append(_host_slots(host, slots, item))
    if not out:
        raise InvalidInputError(f"no hosts in {spec!r}")
    return out


def parse_hostfile(path: str | os.PathLike) -> list[HostSlots]:
    """Parse a host file: one ``host``, ``host:N`` or ``host slots=N`` per line.

    Parameters
    ----------
    path : str or os.PathLike
        The file; ``#`` starts a comment, blank lines are skipped.

    Returns
    -------
    list of HostSlots
        The entries in file order.
    """
    out = []
    for line in Path(path).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = "1"
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots":
                slots = value
        if len(words) == 1 and ":" in words[0]:
            out.extend(parse_hosts(words[0]))
        else:
            out.append(_host_slots(words[0], slots, line.strip()))
    if not out:
        raise InvalidInputError(f"no hosts in host file {path}")
    return out


def _host_slots(host: str, slots: str, text: str) -> HostSlots:
    try:
        n = int(slots)
    except ValueError:
        n = 0
    if not host or n < 1:
        raise InvalidInputError(f"bad host entry {text!r}: expected host[:slots] with slots >= 1")
    return HostSlots(host, n)


def is_local_host(host: str) -> bool:
    """True for the names of this machine (ranks there are started without ssh)."""
    name = socket.gethostname()
    return host in ("localhost", "127.0.0.1", "::1", name, name.split(".")[0])


# ---------------------------------------------------------------------------- plan
@dataclass
class RankSpec:
    """How to start one rank."""

    rank: int
    host: str
    argv: list[str]
    env: dict[str, str]
    remote: bool


def _scrubbed_env(base: Mapping[str, str]) -> dict[str, str]:
    # What this process's own init() set from HOROVOD_* variables (a notebook that
    # initialised, then launches) is not the user's: the ranks work it out again.
    derived = {"RINGREDUCE_FROM_HOROVOD",
               *base.get("RINGREDUCE_FROM_HOROVOD", "").split(",")}
    return {k: v for k, v in base.items() if k not in SCRUBBED_VARS and k not in derived
            and not k.startswith(SCRUBBED_PREFIXES)}


def settings_only(base: Mapping[str, str]) -> dict[str, str]:
    """The ``RINGREDUCE_*`` and ``HOROVOD_*`` variables of ``base``: what a rank started
    elsewhere (a remote host, a Spark task, a Ray actor) gets from the launching process."""
    return {k: v for k, v in base.items() if k.startswith(("RINGREDUCE_", "HOROVOD_"))}


def _parse_env(items: Sequence[str], base: Mapping[str, str]) -> dict[str, str]:
    """``VAR=VAL`` sets a variable; ``VAR`` alone forwards this process's value."""
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name:
            raise InvalidInputError(f"bad --env {item!r}: expected VAR=VAL or VAR")
        if eq:
            out[name] = value
        elif name in base:
            out[name] = base[name]
    return out


def _ssh_argv(ssh_command: Optional[str], ssh_port: Optional[int], host: str,
              cmdline: str) -> list[str]:
    """``<ssh command> <host> <command line>``, or ``{host}`` replaced where it appears."""
    words = list(DEFAULT_SSH) if ssh_command is None else shlex.split(ssh_command)
    if ssh_port is not None and words and os.path.basename(words[0]) == "ssh":
        words[1:1] = ["-p", str(ssh_port)]
    if any("{host}" in w for w in words):
        return [w.replace("{host}", host) for w in words] + [cmdline]
    return [*words, host, cmdline]


def ssh_with_identity(identity_file: str) -> str:
    """The default ssh command with ``-i identity_file`` (horovodrun's ``-i``)."""
    return shlex.join([*DEFAULT_SSH, "-i", identity_file])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def plan(command: Sequence[str], np: Optional[int] = None,
         hosts: Optional[Sequence[HostSlots]] = None, master_addr: Optional[str] = None,
         master_port: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
         ssh_command: Optional[str] = None, ssh_port: Optional[int] = None,
         base_env: Optional[Mapping[str, str]] = None) -> list[RankSpec]:
    """Place ``np`` ranks on ``hosts`` (in order) and build each rank's argv and environment.

    Local ranks get this environment (minus launcher variables) and run ``command``
    directly; remote ranks run ``<ssh> host 'cd CWD; exec env VARS... command'`` with the
    launch variables, every ``RINGREDUCE_*`` and ``HOROVOD_*`` variable and ``env`` forwarded.
    """
    if not command:
        raise InvalidInputError("no command given")
    hosts = list(hosts) if hosts else [HostSlots("localhost", np or 1)]
    total = sum(h.slots for h in hosts)
    np = total if np is None else np
    if np < 1 or np > total:
        raise InvalidInputError(f"-np {np} does not fit the {total} slot(s) of the host list")
    places = [h for h in hosts for _ in range(h.slots)][:np]
    local = [is_local_host(h.host) for h in places]
    if master_addr is None:
        if all(local):
            master_addr = "127.0.0.1"
        else:
            master_addr = socket.gethostname() if local[0] else places[0].host
    base = _scrubbed_env(os.environ if base_env is None else base_env)
    launch = {"WORLD_SIZE": str(np), "MASTER_ADDR": master_addr,
              "MASTER_PORT": str(master_port or _free_port()),
              "RINGREDUCE_SECRET": secrets.token_hex(32)}
    extra = dict(env or {})
    specs = []
    for rank, place in enumerate(places):
        same = [i for i, p in enumerate(places) if p == place]
        mine = {**launch, "RANK": str(rank), "LOCAL_RANK": str(same.index(rank)),
                "LOCAL_WORLD_SIZE": str(len(same)),
                **omp_wait_policy({**base, **extra}, len(same), local[rank])}
        specs.append(rank_spec(rank, command, place.host, local[rank], base,
                               {**mine, **extra}, ssh_command, ssh_port))
    return specs


def rank_spec(rank: int, command: Sequence[str], host: str, local: bool,
              base: Mapping[str, str], mine: Mapping[str, str], ssh_command: Optional[str],
              ssh_port: Optional[int]) -> RankSpec:
    """How to start one process on ``host``: locally with ``base`` plus ``mine``, or over
    ``ssh_command`` with ``mine`` and the ``RINGREDUCE_*`` variables of ``base``."""
    if local:
        return RankSpec(rank, host, list(command), {"PYTHONUNBUFFERED": "1", **base, **mine},
                        False)
    forwarded = settings_only(base)
    remote_env = {"PYTHONUNBUFFERED": "1", **forwarded, "RINGREDUCE_HOST_ID": f"ringrun:{host}",
                  **mine}
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in remote_env.items())
    cmdline = (f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec env {assignments} "
               + " ".join(shlex.quote(w) for w in command))
    argv = _ssh_argv(ssh_command, ssh_port, host, cmdline)
    return RankSpec(rank, host, argv, {"PYTHONUNBUFFERED": "1", **base}, True)


def omp_wait_policy(env: Mapping[str, str], ranks_here: int, local: bool) -> dict[str, str]:
    """``{"OMP_WAIT_POLICY": "PASSIVE"}`` where a host's ranks oversubscribe its cores.

    OpenMP's waiting threads spin by default. When the ranks of one host run more compute
    threads than it has cores (torch's default is a thread per core in every rank), a
    thread that waits for its partner spins on a core the partner needs: at ``-np 2`` on
    2 cores, torch's default thread count took 1.6-3x the CPU per step and half the
    throughput of ``PASSIVE`` (``benchmarks/train_scaling.py``, README "Under
    contention"), for ringreduce and DDP alike.

    Parameters
    ----------
    env : mapping
        The rank's environment (launcher's plus ``--env``). An ``OMP_WAIT_POLICY`` there
        (``ACTIVE`` keeps the spinning) is left alone.
    ranks_here : int
        Ranks placed on this rank's host.
    local : bool
        Whether that host is this one (its cores are known).

    Returns
    -------
    dict
        The variable to add, or nothing.
    """
    if "OMP_WAIT_POLICY" in env or ranks_here < 2:
        return {}
    threads = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if threads:  # the script chose a thread count: oversubscribed only beyond the cores
        if not local or not threads.isdigit():
            return {}
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        if ranks_here * int(threads) <= cores:
            return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


# --------------------------------------------------------------------------- output
def _binary(stream: IO) -> Callable[[bytes], None]:
    """A writer of whole lines to ``stream`` (its binary buffer if it has one)."""
    raw = getattr(stream, "buffer", None)

    def write(data: bytes) -> None:
        if raw is not None:
            stream.flush()
            raw.write(data)
            raw.flush()
        else:
            stream.write(data.decode(errors="replace"))
            stream.flush()

    return write


def _pump(pipe: IO[bytes], write: Callable[[bytes], None], prefix: bytes,
          lock: threading.Lock, copy: Optional[IO[bytes]] = None, stamp: bool = False) -> None:
    """Copy ``pipe`` to ``write`` line by line, each line whole and prefixed (after the
    time with ``stamp``, as horovodrun's ``time.asctime()``); also, without the prefix, to
    ``copy`` (closed at the end) if given."""
    broken = False  # our own output closed (e.g. `ringrun ... | head`): keep draining
    with pipe, copy or contextlib.nullcontext():
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            when = time.asctime().encode() if stamp else b""
            if copy is not None:  # the file has no "[rank]: " to follow the time
                copy = _copied(copy, when + b" " + line if stamp else line)
            if broken:
                continue
            head = when + (prefix or b" " if stamp else prefix)
            with lock:
                try:
                    write(head + line)
                except (OSError, ValueError):
                    broken = True


def _copied(copy: IO[bytes], line: bytes) -> Optional[IO[bytes]]:
    """Write ``line`` to an output file; on failure (a full disk) say so once and stop
    copying, so that the rank, and ringrun's own output, go on."""
    try:
        copy.write(line)
        copy.flush()
        return copy
    except OSError as err:
        _say(f"cannot write {copy.name} ({err}); no more output goes there")
        with contextlib.suppress(OSError):
            copy.close()
        return None


def output_files(directory: str, name: str) -> tuple[IO[bytes], IO[bytes]]:
    """``directory/name/stdout`` and ``.../stderr``, opened for writing (horovodrun's
    ``--output-filename`` layout)."""
    where = os.path.join(directory, name)
    os.makedirs(where, exist_ok=True)
    out = open(os.path.join(where, "stdout"), "wb")
    try:
        return out, open(os.path.join(where, "stderr"), "wb")
    except OSError:
        out.close()
        raise


def padded_rank(rank: int, size: int) -> str:
    """``rank`` with leading zeros, so that ``rank.<N>`` folders sort in rank order."""
    return str(rank).zfill(len(str(max(size - 1, 0))))


def _say(text: str) -> None:
    # One write of the whole line: print() writes the text and its newline apart, and a
    # rank's line relayed between the two (the pumps write from their own threads) got
    # glued to ours ("... 1=w2@b[w3@c]: ...").
    sys.stderr.write(f"ringrun: {text}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------------ job
@dataclass
class OutputSettings:
    """Where ranks' output goes besides ringrun's own stdout/stderr."""

    directory: Optional[str] = None  # also to <directory>/<name>/stdout, stderr
    timestamp: bool = False  # each line starts with the time
    verbose: bool = False  # ringrun says where each process started

    def files(self, name: str) -> tuple[Optional[IO[bytes]], Optional[IO[bytes]]]:
        """The copies of one process's stdout and stderr (None, None without a directory)."""
        return output_files(self.directory, name) if self.directory else (None, None)

    @staticmethod
    def close(copies: Sequence[Optional[IO[bytes]]]) -> None:
        """Close what ``files`` opened for a process that did not start."""
        for copy in copies:
            if copy is not None:
                copy.close()


@dataclass
class Outcome:
    """How a job ended: the launcher's exit code and, if one rank failed, which."""

    code: int
    failed_rank: Optional[int] = None
    codes: list[Optional[int]] = field(default_factory=list)  # each rank's returncode


class _Job:
    """The running ranks: started in sessions of their own, watched, stopped together."""

    def __init__(self, specs: Sequence[RankSpec], prefix: bool, grace: float,
                 output: Optional[OutputSettings] = None) -> None:
        self.specs = list(specs)
        self.prefix = prefix
        self.grace = grace
        self.output = output or OutputSettings()
        self.procs: list[Optional[subprocess.Popen]] = []
        self.codes: list[Optional[int]] = [None] * len(self.specs)
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.signum: Optional[int] = None
        self.kill_at: Optional[float] = None  # SIGKILL what is left at this time

    def start(self) -> Optional[Outcome]:
        """Start every rank; an Outcome if one cannot be started (the rest are stopped)."""
        out, err = _binary(sys.stdout), _binary(sys.stderr)
        for spec in self.specs:
            # Opened first: a rank is never left running without its output's reader.
            copies = self.output.files(f"rank.{padded_rank(spec.rank, len(self.specs))}")
            try:
                proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
            except OSError as e:
                OutputSettings.close(copies)
                _say(f"cannot start rank {spec.rank} ({spec.argv[0]}): {e}")
                self.stop(signal.SIGTERM)
                self.wait_all()
                return Outcome(127, spec.rank, self.codes)
            self.procs.append(proc)
            if self.output.verbose:
                _say(f"rank {spec.rank} started on {spec.host} (pid {proc.pid}"
                     f"{', over ssh' if spec.remote else ''})")
            prefix = f"[{spec.rank}]: ".encode() if self.prefix else b""
            for pipe, write, copy in zip((proc.stdout, proc.stderr), (out, err), copies):
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(pipe, write, prefix, self.lock, copy,
                                           self.output.timestamp))
                t.start()
                self.threads.append(t)
        return None

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if self.codes[i] is None]

    def reap(self) -> list[int]:
        """Ranks that ended since the last call; leftovers of their sessions are SIGKILLed."""
        ended = []
        for i in self.running():
            pid = self.procs[i].pid
            try:  # WNOWAIT: the zombie keeps its group id ours until the leftovers are killed
                status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                status = True
            if status is None:
                continue
            self._signal_group(pid, signal.SIGKILL)
            self.codes[i] = self.procs[i].wait()
            ended.append(i)
        return ended

    @staticmethod
    def _signal_group(pid: int, signum: int) -> None:
        try:
            os.killpg(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, signum: int) -> None:
        """Send ``signum`` to every running rank's session; SIGKILL after the grace period."""
        for i in self.running():
            self._signal_group(self.procs[i].pid, signum)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace

    def kill_overdue(self) -> None:
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            for i in self.running():
                self._signal_group(self.procs[i].pid, signal.SIGKILL)

    def wait_all(self) -> None:
        """Wait for the started ranks to end (stop() must have been called), then the output."""
        while self.running():
            self.reap()
            self.kill_overdue()
            time.sleep(0.02)
        for t in self.threads:
            t.join(timeout=5)

    def describe(self, i: int) -> str:
        return f"rank {i} (host {self.specs[i].host}, pid {self.procs[i].pid})"


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def _watch(job: _Job, timeout: Optional[float]) -> Outcome:
    """Wait for the job; stop it on the first failure, a signal or the timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    outcome: Optional[Outcome] = None
    handled_signal = None
    while job.running():
        for i in job.reap():
            code = job.codes[i]
            if code != 0 and outcome is None:
                left = len(job.running())
                tail = f"; stopping the other {left} rank{'s' * (left != 1)}" if left else ""
                _say(f"{job.describe(i)} {_how(code)}{tail}")
                outcome = Outcome(_exit_code(code), i)
                job.stop(signal.SIGTERM)
        if job.signum is not None and job.signum != handled_signal:
            if handled_signal is not None:  # a second signal: no more grace
                job.kill_at = time.monotonic()
            else:
                name = signal.Signals(job.signum).name
                _say(f"received {name}; forwarding it to {len(job.running())} rank(s)")
                job.stop(job.signum)
                outcome = outcome or Outcome(128 + job.signum)
            handled_signal = job.signum
        if deadline is not None and outcome is None and time.monotonic() >= deadline:
            _say(f"timed out after {timeout:g} s; stopping all {len(job.running())} "
                 "running rank(s)")
            outcome = Outcome(TIMEOUT_EXIT_CODE)
            job.stop(signal.SIGTERM)
        job.kill_overdue()
        time.sleep(0.02)
    job.wait_all()
    outcome = outcome or Outcome(0)
    outcome.codes = list(job.codes)
    return outcome


def launch(command: Sequence[str], np: Optional[int] = None,
           hosts: Optional[Sequence[HostSlots]] = None, *, master_addr: Optional[str] = None,
           master_port: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
           ssh_command: Optional[str] = None, ssh_port: Optional[int] = None,
           prefix_output: bool = True, timeout: Optional[float] = None,
           grace: float = DEFAULT_GRACE_SECONDS,
           output: Optional[OutputSettings] = None) -> Outcome:
    """Run ``command`` as ``np`` ranks and wait for them (what ``ringrun`` does).

    Parameters
    ----------
    command : sequence of str
        The program of every rank, e.g. ``["python", "train.py"]``.
    np : int, optional
        Number of ranks; default: every slot of ``hosts`` (one rank without hosts).
    hosts : sequence of HostSlots, optional
        Where to start ranks, filled in order; default ``localhost`` with ``np`` slots.
    master_addr, master_port : optional
        Rank 0's rendezvous address; default the first host (127.0.0.1 for a local
        job) and a free port.
    env : mapping, optional
        Extra variables for every rank.
    ssh_command : str, optional
        Command that runs a shell command line on a host: called as
        ``<ssh_command> <host> <command line>``, or with ``{host}`` replaced where it
        appears in ``ssh_command``. Default ``ssh -o BatchMode=yes -o StrictHostKeyChecking=no``.
    ssh_port : int, optional
        ``-p`` for ssh.
    prefix_output : bool
        Prefix each output line with ``[rank]: ``.
    timeout : float, optional
        Stop every rank after this many seconds (the code is then 124).
    grace : float
        Seconds between SIGTERM (or the forwarded signal) and SIGKILL.
    output : OutputSettings, optional
        Also write each rank's output to ``<directory>/rank.<rank>/stdout`` and ``stderr``
        (horovodrun's ``--output-filename``), and/or start each line with the time.

    Returns
    -------
    Outcome
        ``code`` 0 if every rank exited 0; else the first failed rank's code (128+N for
        signal N), 124 on timeout, 128+N when the launcher got signal N.
    """
    specs = plan(command, np, hosts, master_addr, master_port, env, ssh_command, ssh_port)
    job = _Job(specs, prefix_output, grace, output)
    with signals_to(job):
        try:
            failed = job.start()
            return failed if failed is not None else _watch(job, timeout)
        finally:
            if job.running():  # an exception in the launcher itself: leave nothing behind
                job.stop(signal.SIGKILL)
                job.wait_all()


@contextmanager
def signals_to(target: Any) -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP set ``target.signum`` (for the launcher's
    loop to act on) instead of their usual effect; only in the main thread."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        def handler(signum: int, frame: Any) -> None:
            target.signum = signum

        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringrun", allow_abbrev=False,
        description="Start the ranks of a ringreduce job (env-var launch; no MPI needed).",
        epilog="Not a cluster manager: on clusters use `mpirun -hosts h1,h2 -ppn 4 python "
               "train.py` (MPICH) or `srun -n 8 python train.py`.")
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=int,
                   help="number of ranks (default: all slots of the host list)")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots,... (default localhost)")
    p.add_argument("-hostfile", "--hostfile",
                   help="file with lines 'host', 'host:N' or 'host slots=N'")
    p.add_argument("--ssh-command", help="runs a command line on a host: "
                   "'<cmd> <host> <command line>' ({host} in it is replaced instead)")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port (with the default ssh command)")
    p.add_argument("--master-addr", help="rank 0's address (default: first host)")
    p.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument("--prefix-output", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix each output line with '[rank]: ' (default on)")
    p.add_argument("--timeout", type=float, help="stop all ranks after S seconds (exit 124)")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_SECONDS,
                   help="seconds from SIGTERM to SIGKILL when stopping ranks (default 5)")
    p.add_argument("--env", "-x", action="append", default=[], metavar="VAR[=VAL]",
                   help="set VAR for every rank (VAR alone forwards its value); repeatable")
    e = p.add_argument_group("elastic training (Horovod's elastic horovodrun; see README)")
    e.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                   help="fewest workers to train with (makes the job elastic)")
    e.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                   help="most workers to grow to when hosts are added (default -np)")
    e.add_argument("--host-discovery-script", help="prints the current 'host:slots' lines; "
                   "run every second (makes the job elastic)")
    e.add_argument("--slots-per-host", "--slots", dest="slots", type=int, default=1,
                   help="slots of a discovered host printed without ':slots' (default 1)")
    e.add_argument("--elastic-timeout", type=float,
                   help="seconds a new generation may take to form (default 600, or "
                   "HOROVOD_ELASTIC_TIMEOUT)")
    e.add_argument("--reset-limit", type=int,
                   help="end the job after this many resets (default: no limit)")
    e.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=float, nargs=2,
                   metavar=("MIN", "MAX"),
                   help="a failed host comes back after a cooldown of MIN to MAX seconds, "
                   "longer each time it fails (default: it stays blacklisted)")
    _horovodrun.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="program and its arguments")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ringrun`` (and ``python -m ringreduce``).

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit code (see ``launch``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--run-pickled"] and len(argv) == 2:
        from ._run import run_pickled

        return run_pickled(argv[1])
    parser = _parser()
    a = parser.parse_args(argv)
    if a.version or a.check_build:
        from . import __version__

        print(_horovodrun.check_build() if a.check_build else f"ringrun {__version__}")
        return 0
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        parser.error("no command given, e.g. ringrun -np 2 python train.py")
    elastic = a.min_np is not None or a.max_np is not None or a.host_discovery_script
    if not elastic and (a.reset_limit is not None or a.slots != 1 or
                        a.elastic_timeout is not None or a.cooldown_range is not None):
        parser.error("--slots, --elastic-timeout, --reset-limit and --blacklist-cooldown-range "
                     "are for elastic jobs: give --min-np / --max-np (or "
                     "--host-discovery-script) too")
    if a.cooldown_range is not None and not 0 < a.cooldown_range[0] <= a.cooldown_range[1]:
        parser.error("--blacklist-cooldown-range MIN MAX needs 0 < MIN <= MAX (seconds)")
    if a.host_discovery_script and a.np is None and a.min_np is None and a.max_np is None:
        parser.error("--host-discovery-script needs -np, --min-np or --max-np")
    if a.np is None and not (a.hosts or a.hostfile or elastic):
        parser.error("give -np N (or a host list with -H / --hostfile)")
    try:
        _horovod_flags(a)
        if elastic:
            return _main_elastic(a, command)
        hosts = parse_hosts(a.hosts) if a.hosts else None
        if a.hostfile:
            hosts = (hosts or []) + parse_hostfile(a.hostfile)
        outcome = launch(command, a.np, hosts, master_addr=a.master_addr,
                         master_port=a.master_port, env=a.rank_env,
                         ssh_command=a.ssh_command, ssh_port=a.ssh_port,
                         prefix_output=a.prefix_output, timeout=a.timeout,
                         grace=a.grace_period, output=a.output)
    except (InvalidInputError, OSError) as e:
        parser.error(str(e))
    return outcome.code


def _horovod_flags(a: argparse.Namespace) -> None:
    """horovodrun's flags into what ringrun uses: ``a.rank_env`` (every rank's extra
    variables, ``--env`` last), ``a.output``, and the ssh command for ``-i``."""
    if a.config_file:
        _horovodrun.apply_config_file(a)
    why = _horovodrun.refused(a)
    if why:
        raise InvalidInputError(why)
    env, useless = _horovodrun.rank_env(a)
    if useless:
        _say(f"{', '.join(useless)}: no effect in ringreduce (see the README's Settings)")
    a.rank_env = {**env, **_parse_env(a.env, os.environ)}
    a.output = OutputSettings(a.output_filename, a.prefix_timestamp, a.verbose)
    if a.output_filename:  # a folder that cannot be made is a usage error, before any start
        os.makedirs(a.output_filename, exist_ok=True)
    if a.ssh_identity_file:
        a.ssh_command = ssh_with_identity(a.ssh_identity_file)


def _main_elastic(a: argparse.Namespace, command: list[str]) -> int:
    from .elastic.discovery import FixedHosts, ScriptHosts
    from .elastic.driver import ElasticSettings, launch_elastic

    if a.host_discovery_script and (a.hosts or a.hostfile):
        raise InvalidInputError("give --host-discovery-script or -H/--hostfile, not both")
    if a.host_discovery_script:
        discovery = ScriptHosts(a.host_discovery_script, a.slots)
    else:
        hosts = parse_hosts(a.hosts) if a.hosts else []
        hosts += parse_hostfile(a.hostfile) if a.hostfile else []
        discovery = FixedHosts(hosts or [HostSlots("localhost", a.max_np or a.np or 1)])
    np = a.np or a.min_np or a.max_np
    settings = ElasticSettings(min_np=a.min_np or np, max_np=a.max_np or np, np=np,
                               elastic_timeout=elastic_timeout(a.elastic_timeout),
                               reset_limit=a.reset_limit,
                               cooldown_range=a.cooldown_range and tuple(a.cooldown_range))
    return launch_elastic(command, discovery, settings, env=a.rank_env,
                          ssh_command=a.ssh_command, ssh_port=a.ssh_port,
                          driver_addr=a.master_addr, prefix_output=a.prefix_output,
                          timeout=a.timeout, grace=a.grace_period, output=a.output)
