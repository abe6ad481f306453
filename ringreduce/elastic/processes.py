"""How the elastic driver starts a worker and watches it.

The driver (``driver.py``) forms generations from whatever workers exist; how a worker
comes to exist is a ``Spawn``: a callable that starts worker ``wid`` on a slot of a host
with the driver's variables in its environment and returns a ``WorkerProcess``, the
driver's handle on it. ``ringrun`` spawns processes (locally, or over ssh:
``ProcessSpawner``); ``ringreduce.ray`` spawns Ray actors. The driver only ever polls a
handle, stops it and kills it, so the generation protocol is the same for both.

A handle's life: ``poll()`` is None while the worker runs, then its exit code for good
(0 when training finished or the worker left the job, non-zero when it failed; a
negative -N for a worker killed by signal N, as ``subprocess``); ``terminate()`` asks it to
stop, ``kill()`` stops it at once and anything it left behind (both harmless when it has
ended); ``close()`` waits a little for what relays its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Callable, Optional, Protocol

from ..launcher import (
    HostSlots,
    OutputSettings,
    _binary,
    _pump,
    _say,
    _scrubbed_env,
    is_local_host,
    omp_wait_policy,
    rank_spec,
)

__all__ = ["ProcessSpawner", "Spawn", "WorkerProcess"]


class WorkerProcess(Protocol):
    """The driver's handle on one worker (see the module docstring)."""

    where: str  # for log lines: "pid 9472", "actor 1f2e..."

    def poll(self) -> Optional[int]: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def close(self, timeout: float) -> None: ...


# (worker id, its host, its slot there, the driver's variables) -> the worker's handle;
# raises OSError when the worker cannot be started (the driver blacklists the host)
Spawn = Callable[[str, HostSlots, int, dict], WorkerProcess]


class SessionProcess:
    """A worker process in a session of its own (an ssh client for a remote one), with
    the threads that relay its output; signals go to the whole session."""

    def __init__(self, proc: subprocess.Popen, threads: Sequence[threading.Thread]) -> None:
        self.proc, self.threads = proc, list(threads)
        self.where = f"pid {proc.pid}"

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)  # also what an exited worker left in its session

    def close(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout=timeout)


class ProcessSpawner:
    """``ringrun``'s workers: ``command`` as a process on the host (over ``ssh_command``
    for a remote one), its output relayed line by line, prefixed ``[wid@host]: ``, and
    copied to ``--output-filename``'s ``worker.<N>`` folder."""

    def __init__(self, command: Sequence[str], env: dict, ssh_command: Optional[str],
                 ssh_port: Optional[int], prefix: bool,
                 output: Optional[OutputSettings] = None) -> None:
        self.command, self.extra = list(command), env
        self.ssh_command, self.ssh_port = ssh_command, ssh_port
        self.prefix, self.output = prefix, output or OutputSettings()
        self.out, self.err, self.lock = _binary(sys.stdout), _binary(sys.stderr), threading.Lock()

    def __call__(self, wid: str, host: HostSlots, slot: int, mine: dict) -> SessionProcess:
        local = is_local_host(host.host)
        base = _scrubbed_env(os.environ)
        mine = {**mine, **omp_wait_policy({**base, **self.extra}, host.slots, local),
                **self.extra}
        spec = rank_spec(int(wid[1:]), self.command, host.host, local, base, mine,
                         self.ssh_command, self.ssh_port)
        copies = self._output_files(wid)
        try:
            proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as err:
            OutputSettings.close(copies)
            raise OSError(f"{spec.argv[0]}: {err}") from err
        prefix = f"[{wid}@{host.host}]: ".encode() if self.prefix else b""
        threads = []
        for pipe, write, copy in zip((proc.stdout, proc.stderr), (self.out, self.err), copies):
            t = threading.Thread(target=_pump, daemon=True,
                                 args=(pipe, write, prefix, self.lock, copy,
                                       self.output.timestamp))
            t.start()
            threads.append(t)
        return SessionProcess(proc, threads)

    def _output_files(self, wid: str) -> tuple:
        """``--output-filename``'s files of worker ``wid`` (None, None if they cannot be
        made: the job goes on, its output on ringrun's own only)."""
        try:
            return self.output.files(f"worker.{wid[1:]}")
        except OSError as err:
            _say(f"cannot write worker {wid}'s output files ({err}); its output goes to "
                 "ringrun's only")
            return None, None
