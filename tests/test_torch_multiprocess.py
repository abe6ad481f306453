"""ringreduce.torch in real processes: a worker, the examples at -np 1 and -np 2, resume.

Each launch has a hard timeout and leaves no process behind (tests/procs.py).
These are the slowest torch tests (a few seconds per launch: importing torch).
"""

from __future__ import annotations

import re

import pytest
from procs import ROOT, Job, require_mpirun, run_env_launch, run_mpi

pytest.importorskip("torch")

EXAMPLE = ROOT / "examples" / "pytorch_train.py"
HOROVOD_STYLE = ROOT / "examples" / "horovod_style.py"


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


def final_accuracy(job: Job) -> float:
    found = re.findall(r"final test accuracy: ([0-9.]+)", job.procs[0].stdout)
    assert len(found) == 1, f"expected one accuracy line (from rank 0)\n{job.describe()}"
    return float(found[0])


def test_pytorch_example_np1_np2_and_resume(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    require_mpirun()
    epochs = 8
    acc, ckpt = {}, {}
    for np_ in (1, 2):
        ckpt[np_] = tmp_path / f"np{np_}"
        job = run_mpi(np_, EXAMPLE, ["--epochs", epochs, "--checkpoint-dir", ckpt[np_]],
                      timeout=120)
        job.check_ok()
        acc[np_] = final_accuracy(job)
        files = sorted(p.name for p in ckpt[np_].iterdir())
        assert files == ["ckpt.pt"], f"-np {np_}: checkpoint dir holds {files}"
    assert min(acc.values()) >= 0.95, f"final accuracies {acc}"

    # Resuming a finished run trains no further and reports the same accuracy.
    saved = (ckpt[2] / "ckpt.pt").read_bytes()
    args = ["--epochs", epochs, "--checkpoint-dir", ckpt[2], "--resume"]
    job = run_mpi(2, EXAMPLE, args, timeout=120)
    job.check_ok()
    assert final_accuracy(job) == acc[2]
    assert (ckpt[2] / "ckpt.pt").read_bytes() == saved, "a finished run was trained further"

    # Resuming with more epochs continues from the checkpoint.
    args[1] = epochs + 1
    job = run_mpi(2, EXAMPLE, args, timeout=120)
    job.check_ok()
    assert final_accuracy(job) >= 0.95
    import torch

    assert torch.load(ckpt[2] / "ckpt.pt")["epoch"] == epochs + 1


def test_resume_without_checkpoint_fails_on_every_rank(tmp_path):
    require_mpirun()
    job = run_mpi(2, EXAMPLE, ["--epochs", 1, "--checkpoint-dir", tmp_path, "--resume"],
                  timeout=120)
    assert not job.timed_out and job.procs[0].returncode != 0, job.describe()
    out = job.procs[0].stdout + job.procs[0].stderr
    for r in range(2):
        assert f"load_checkpoint on rank {r}: rank 0 reports: no checkpoint at" in out, out


def test_horovod_style_example():
    job = run_mpi(2, HOROVOD_STYLE, timeout=120)
    job.check_ok()
    assert "weights equal on all 2 ranks: True" in job.procs[0].stdout, job.describe()


def test_dataloader_workers_forked_after_init():
    # DataLoader(num_workers=2) forks children after init() every epoch: training through
    # them equals num_workers=0 bitwise, and the job goes on (tests/workers/dataloader_worker.py).
    job = run_mpi(2, "dataloader_worker.py", timeout=120)
    job.check_ok(expect_ranks=2)
