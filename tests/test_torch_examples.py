"""The PyTorch examples under real ``mpirun -np 2``: the README's quick start
(``examples/pytorch_train.py``: accuracy, checkpoint, resume, a resume without a checkpoint
failing on every rank), the Horovod-style script,
and Horovod's own PyTorch examples (digits instead of MNIST; the synthetic benchmark)
with only the import changed, Adasum and fp16 compression included.

One launch runs the eight scripts one after another in each rank's process
(tests/script_jobs.py: each torch process costs ~8 CPU-seconds of imports). At -np 2
only: the scripts' code is the same at any size. The launch has a hard timeout and
leaves no process behind (tests/procs.py).
"""

from __future__ import annotations

import re

import pytest
from procs import ROOT, require_mpirun
from script_jobs import Script, ScriptJob, final_accuracy, run_scripts

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

EXAMPLE = ROOT / "examples" / "pytorch_train.py"
HOROVOD_STYLE = ROOT / "examples" / "horovod_style.py"
HOROVOD = ROOT / "examples" / "horovod"
EPOCHS = 8
TIMEOUT = 300  # seconds for the eight; they take ~60 s on the 2-core VM


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> ScriptJob:
    require_mpirun()
    work = tmp_path_factory.mktemp("torch-examples")
    ckpt = work / "ckpt"
    train = ["--epochs", EPOCHS, "--checkpoint-dir", ckpt]
    scripts = [
        Script("train", EXAMPLE, train, ckpt),
        Script("resume-finished", EXAMPLE, [*train, "--resume"], ckpt),
        Script("resume-more", EXAMPLE, ["--epochs", EPOCHS + 1, "--checkpoint-dir", ckpt,
                                        "--resume"], ckpt),
        Script("resume-missing", EXAMPLE, ["--epochs", 1, "--checkpoint-dir", work / "none",
                                           "--resume"], work / "none", fails=True),
        Script("horovod-style", HOROVOD_STYLE, [], work / "horovod-style"),
        Script("mnist", HOROVOD / "pytorch_mnist.py", ["--epochs", 8], work / "mnist"),
        Script("mnist-adasum-fp16", HOROVOD / "pytorch_mnist.py",
               ["--epochs", 8, "--use-adasum", "--fp16-allreduce"], work / "mnist-adasum"),
        Script("synthetic", HOROVOD / "pytorch_synthetic_benchmark.py",
               ["--use-adasum", "--num-iters", 2, "--num-batches-per-iter", 1,
                "--batch-size", 4], work / "synthetic"),
    ]
    return run_scripts(2, scripts, work, {}, TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 60)
def test_pytorch_example_and_resume(job):
    run = job.check("train")
    acc = final_accuracy(run)
    assert run.files() == ["ckpt.pt"], f"the checkpoint dir holds {run.files()}"
    assert acc >= 0.95, f"final accuracy {acc}"

    # Resuming a finished run trains no further and reports the same accuracy.
    again = job.check("resume-finished")
    assert final_accuracy(again) == acc
    assert again.digests() == run.digests(), "a finished run was trained further"

    # Resuming with more epochs continues from the checkpoint.
    more = job.check("resume-more")
    assert final_accuracy(more) >= 0.95
    import torch

    assert torch.load(more.cwd / "ckpt.pt")["epoch"] == EPOCHS + 1


@pytest.mark.timeout(TIMEOUT + 60)
def test_resume_without_checkpoint_fails_on_every_rank(job):
    run = job.check("resume-missing")  # it raised on both ranks, and the job went on
    for r in range(2):
        err = run.errors(r)
        assert f"load_checkpoint on rank {r}: rank 0 reports: no checkpoint at" in err, err


@pytest.mark.timeout(TIMEOUT + 60)
def test_horovod_style_example(job):
    out = job.check("horovod-style").output()
    assert "weights equal on all 2 ranks: True" in out, out


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("label", ["mnist", "mnist-adasum-fp16"])
def test_horovod_mnist_example(job, label):
    assert final_accuracy(job.check(label)) >= 0.9


@pytest.mark.timeout(TIMEOUT + 60)
def test_horovod_synthetic_benchmark_with_adasum(job):
    out = job.check("synthetic").output()
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", out), out
