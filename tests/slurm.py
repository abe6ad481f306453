"""A private one-node SLURM cluster for the tests: munged, slurmctld and slurmd started
with a slurm.conf in a temporary folder (their own ports and state), torn down in a
``finally`` however the test ends. Needs root and Debian's ``slurm-wlm`` and ``munge``
(``.ci/run`` installs them when it can); ``Slurm.skip_reason()`` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

BINARIES = ("srun", "sinfo", "slurmctld", "slurmd", "munged")

CONF = """ClusterName=rrtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def skip_reason() -> Optional[str]:
    """Why a private cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm munge")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids(name: str) -> set[int]:
    out = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _reap_steps(before: set[int], deadline: float) -> None:
    """Wait for the step daemons the cluster started to leave; kill those that stay."""
    while _pids("slurmstepd") - before and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in _pids("slurmstepd") - before:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


@contextmanager
def cluster(timeout: float = 30) -> Iterator[dict]:
    """Start a one-node cluster; yield the environment that points srun at it."""
    workdir = Path(tempfile.mkdtemp(prefix="rr-slurm-"))
    for sub in ("state", "spool"):
        (workdir / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    (workdir / "slurm.conf").write_text(CONF.format(
        host=host, dir=workdir, ctld_port=_free_port(), d_port=_free_port(),
        cpus=os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(workdir / "slurm.conf")}
    daemons: list[subprocess.Popen] = []
    steps_before = _pids("slurmstepd")
    try:
        if not _pids("munged"):
            # Debian's init script makes munged's socket directory; without an init
            # system (a container whose package install started nothing) nobody has.
            Path("/run/munge").mkdir(mode=0o755, parents=True, exist_ok=True)
            daemons.append(subprocess.Popen(["munged", "--foreground", "--force"],
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        for cmd in (["slurmctld", "-D"], ["slurmd", "-D"]):
            daemons.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        _wait_idle(env, workdir, time.monotonic() + timeout)
        yield env
    finally:
        for d in reversed(daemons):
            d.terminate()
        for d in reversed(daemons):
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
        _reap_steps(steps_before, time.monotonic() + 10)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_idle(env: dict, workdir: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip() == "idle":
            return
        time.sleep(0.3)
    logs = "\n".join(p.read_text()[-2000:] for p in workdir.glob("*.log"))
    raise RuntimeError(f"the private SLURM node did not become idle:\n{logs}")
