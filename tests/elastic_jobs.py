"""Launching elastic jobs (``ringrun --min-np ...``) in the tests, with hard timeouts.

Hosts are names the fake ssh (``tests/workers/fake_ssh.py``) runs locally; ringrun gives
each remote host its own ``RINGREDUCE_HOST_ID``, so workers on different names are
different hosts to ringreduce (TCP between them, shared memory within one). A discovery
script here is a file the test rewrites: ``cat hosts.txt``.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from procs import PYTHON, WORKERS, Job, base_env, run_procs

FAKE_SSH = f"{PYTHON} {WORKERS / 'fake_ssh.py'}"
RINGRUN = [PYTHON, "-m", "ringreduce"]
GENERATION = re.compile(r"ringrun: generation (\d+): (\d+) rank\(s\): (.*)$", re.M)


def elastic_args(min_np: int, max_np: int, np: Optional[int] = None,
                 hosts: Optional[str] = None, discovery: Optional[Path] = None,
                 extra: Sequence[str] = ()) -> list[str]:
    """ringrun's arguments for an elastic job on fake hosts (``a:1,b:1``) or a discovery
    file whose lines the test rewrites."""
    args = ["--min-np", str(min_np), "--max-np", str(max_np), "--ssh-command", FAKE_SSH,
            "--master-addr", "127.0.0.1"]
    if np is not None:
        args += ["-np", str(np)]
    if hosts:
        args += ["-H", hosts]
    if discovery is not None:
        args += ["--host-discovery-script", f"cat {discovery}"]
    return [*args, *extra]


def run_elastic(args: Sequence[str], command: Sequence[str], timeout: float = 60,
                env: Optional[dict] = None) -> Job:
    """``ringrun ARGS COMMAND`` with a hard timeout; output in the Job's stdout/stderr."""
    log_dir = Path(tempfile.mkdtemp(prefix="rr-elastic-"))
    return run_procs([("ringrun", [*RINGRUN, *args, *command], base_env(env, log_dir))],
                     timeout, log_dir)


def generations(job: Job) -> list[list[str]]:
    """The members (``w1@a``...) of each generation the driver formed, in rank order."""
    text = job.procs[0].stderr
    return [[m.split("=", 1)[1] for m in g.group(3).split(", ")]
            for g in GENERATION.finditer(text)]
