"""ringreduce.torch in real processes: a worker under both launches, DataLoader workers
forked after init (the examples: tests/test_torch_examples.py).

Each launch has a hard timeout and leaves no process behind (tests/procs.py).
These are the slowest torch tests (a few seconds per launch: importing torch).
"""

from __future__ import annotations

import pytest
from procs import run_env_launch, run_mpi

pytest.importorskip("torch")


@pytest.mark.parametrize("launch", ["mpirun", "env"])
def test_torch_worker(tmp_path, launch):
    if launch == "mpirun":
        job = run_mpi(2, "torch_worker.py", [tmp_path], timeout=120)
    else:
        job = run_env_launch(2, "torch_worker.py", [tmp_path], timeout=120)
    job.check_ok(expect_ranks=2)
    for r in range(2):
        msg = job.event(r, "missing-error")["msg"]
        assert f"on rank {r}" in msg and "rank 0 reports: no checkpoint at" in msg, msg
        assert job.event(r, "compiled")["diff"] <= 1e-12  # torch.compile(model) trains alike


def test_dataloader_workers_forked_after_init():
    # DataLoader(num_workers=2) forks children after init() every epoch: training through
    # them equals num_workers=0 bitwise, and the job goes on (tests/workers/dataloader_worker.py).
    job = run_mpi(2, "dataloader_worker.py", timeout=120)
    job.check_ok(expect_ranks=2)
