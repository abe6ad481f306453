"""ringreduce under a real ``srun`` (a private one-node SLURM cluster, tests/slurm.py):
ranks found through mpi4py and SLURM's PMI-2 (``--mpi=pmi2``), and a clear error on every
task when srun gives MPI no process manager interface (each task would otherwise train
alone as rank 0 of 1).
"""

from __future__ import annotations

import json

import pytest
import slurm
from procs import PYTHON, _new_log_dir, base_env, run_procs

pytestmark = pytest.mark.skipif(slurm.skip_reason() is not None,
                                reason=slurm.skip_reason() or "")

CODE = """
import json, numpy as np, ringreduce as rr
try:
    rr.init()
except rr.RingReduceError as err:
    print(json.dumps({"error": str(err)}), flush=True)
    raise SystemExit(3)
x = np.full(4, rr.rank() + 1.0)
print(json.dumps({"rank": rr.rank(), "size": rr.size(), "local": rr.local_rank(),
                  "sum": rr.allreduce(x, op=rr.Sum).tolist()}), flush=True)
rr.shutdown()
"""


@pytest.fixture(scope="module")
def cluster_env():
    with slurm.cluster() as env:
        yield env


def srun(env: dict, *flags: str):
    log_dir = _new_log_dir(None)
    run_env = base_env({"SLURM_CONF": env["SLURM_CONF"]}, log_dir)
    job = run_procs([("srun", ["srun", "-n", "2", *flags, PYTHON, "-c", CODE], run_env)],
                    timeout=90, log_dir=log_dir)
    assert not job.timed_out, job.describe()
    lines = [json.loads(line) for line in job.procs[0].stdout.splitlines()
             if line.startswith("{")]
    return job, lines


def test_srun_with_pmi2_finds_the_ranks(cluster_env):
    job, lines = srun(cluster_env, "--mpi=pmi2")
    assert job.procs[0].returncode == 0, job.describe()
    assert sorted((r["rank"], r["size"], r["local"]) for r in lines) == [(0, 2, 0), (1, 2, 1)]
    assert all(r["sum"] == [3.0] * 4 for r in lines), lines


def test_srun_without_pmi_fails_clearly_on_every_task(cluster_env):
    job, lines = srun(cluster_env, "--mpi=none")
    assert job.procs[0].returncode != 0, job.describe()
    assert len(lines) == 2 and all("error" in r for r in lines), job.describe()
    for r in lines:
        assert "srun started 2 tasks" in r["error"] and "--mpi=pmi2" in r["error"], r
