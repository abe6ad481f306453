"""The TensorFlow and Keras examples in real processes: accuracy, checkpoints, resume.

Five launches in all (each has a hard timeout and leaves no process behind, see
tests/procs.py); importing TensorFlow costs ~10 CPU-seconds per process, so the epochs
are few and no launch repeats another's code.
"""

from __future__ import annotations

import json
import re

import pytest
from procs import ROOT, Job, require_mpirun, run_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytest.importorskip("sklearn")

EXAMPLES = ROOT / "examples"
KERAS = EXAMPLES / "keras_train.py"
TF2 = EXAMPLES / "tf2_custom_loop.py"
TF1 = EXAMPLES / "tf1_monitored_session.py"
ENV = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
TIMEOUT = 150  # seconds per launch; a launch takes ~10 s


def launch(np_: int, script, args) -> Job:
    job = run_mpi(np_, script, args, env=ENV, timeout=TIMEOUT)
    job.check_ok()
    return job


def final_accuracy(job: Job) -> float:
    found = re.findall(r"final test accuracy: ([0-9.]+)", job.procs[0].stdout)
    assert len(found) == 1, f"expected one accuracy line (from rank 0)\n{job.describe()}"
    return float(found[0])


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_keras_example_and_resume(tmp_path):
    """At -np 2 only: the script's code is the same at any size, and a -np 1 launch cost
    one more TensorFlow process (the suite's time is mostly TensorFlow imports). Two
    launches: a finished run resumed (nothing to train) is the torch example's test."""
    require_mpirun()
    epochs = 10
    job = launch(2, KERAS, ["--epochs", epochs, "--checkpoint-dir", tmp_path])
    assert final_accuracy(job) >= 0.95
    assert files(tmp_path) == ["ckpt.json", "ckpt.keras"]
    assert json.loads((tmp_path / "ckpt.json").read_text())["epoch"] == epochs

    # Resuming with one more epoch runs just that epoch (Keras numbers epochs from 1).
    job = launch(2, KERAS, ["--epochs", epochs + 1, "--checkpoint-dir", tmp_path, "--resume"])
    out = job.procs[0].stdout
    assert f"Epoch {epochs + 1}/{epochs + 1}" in out and f"Epoch {epochs}/" not in out, out
    assert final_accuracy(job) >= 0.95
    assert files(tmp_path) == ["ckpt.json", "ckpt.keras"]
    assert json.loads((tmp_path / "ckpt.json").read_text())["epoch"] == epochs + 1


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_tf2_custom_loop_example_and_resume(tmp_path):
    require_mpirun()
    epochs = 8
    args = ["--epochs", epochs, "--checkpoint-dir", tmp_path]
    job = launch(2, TF2, args)
    assert final_accuracy(job) >= 0.95
    assert f"epoch {epochs}/{epochs}:" in job.procs[0].stdout, job.describe()
    assert files(tmp_path) == ["ckpt.pkl"]

    # --resume with one more epoch continues from the checkpoint: that epoch only.
    job = launch(2, TF2, ["--epochs", epochs + 1, "--checkpoint-dir", tmp_path, "--resume"])
    epochs_run = re.findall(r"^epoch (\d+)/", job.procs[0].stdout, re.M)
    assert epochs_run == [str(epochs + 1)], job.describe()
    assert final_accuracy(job) >= 0.95
    assert files(tmp_path) == ["ckpt.pkl"]


@pytest.mark.timeout(TIMEOUT + 60)
def test_tf1_monitored_session_example(tmp_path):
    require_mpirun()
    job = launch(2, TF1, ["--checkpoint-dir", tmp_path])
    assert final_accuracy(job) >= 0.93
    last = re.search(r"training steps 0 to (\d+) on 2 rank", job.procs[0].stdout)
    assert last, job.describe()
    # Rank 0 alone writes: TensorFlow's checkpoint files, and no temporary ones.
    allowed = re.compile(r"checkpoint|graph\.pbtxt|events\.out\.tfevents\.[\w.-]+|"
                         r"model\.ckpt-\d+\.(index|meta|data-\d{5}-of-\d{5})")
    names = files(tmp_path)
    assert all(allowed.fullmatch(n) for n in names), names
    assert f"model.ckpt-{last[1]}.index" in names, names
    state = (tmp_path / "checkpoint").read_text()
    assert re.match(rf'model_checkpoint_path: "[^"]*model\.ckpt-{last[1]}"\n', state), state
