"""ringreduce.torch in real processes: a worker under both launches, the examples, resume.

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


def test_pytorch_example_and_resume(tmp_path):
    """At -np 2 only (the README's quick start): the script's code is the same at any size,
    and a -np 1 launch cost one more torch process and a whole training."""
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    require_mpirun()
    epochs = 8
    args = ["--epochs", epochs, "--checkpoint-dir", tmp_path]
    job = run_mpi(2, EXAMPLE, args, timeout=120)
    job.check_ok()
    acc = final_accuracy(job)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ckpt.pt"], f"the checkpoint dir holds {files}"
    assert acc >= 0.95, f"final accuracy {acc}"

    # Resuming a finished run trains no further and reports the same accuracy.
    saved = (tmp_path / "ckpt.pt").read_bytes()
    args.append("--resume")
    job = run_mpi(2, EXAMPLE, args, timeout=120)
    job.check_ok()
    assert final_accuracy(job) == acc
    assert (tmp_path / "ckpt.pt").read_bytes() == saved, "a finished run was trained further"

    # Resuming with more epochs continues from the checkpoint.
    args[1] = epochs + 1
    job = run_mpi(2, EXAMPLE, args, timeout=120)
    job.check_ok()
    assert final_accuracy(job) >= 0.95
    import torch

    assert torch.load(tmp_path / "ckpt.pt")["epoch"] == epochs + 1


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
