"""The TensorFlow and Keras examples in real processes: accuracy, checkpoints, resume.

They run in the suite's one TensorFlow launch (conftest.py's ``tensorflow_scripts``,
tests/script_jobs.py: TensorFlow's imports cost ~10 CPU-seconds per process): the Keras
and the custom-loop examples, each resumed with one more epoch, and the TF1 graph
example. At -np 2 only: the scripts' code is the same at any size; a finished run
resumed (nothing to train) is the torch example's test.
"""

from __future__ import annotations

import json
import re

import pytest
from script_jobs import KERAS_EPOCHS, TF2_EPOCHS, TF_TIMEOUT, final_accuracy

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytest.importorskip("sklearn")


@pytest.mark.timeout(TF_TIMEOUT + 60)
def test_keras_example_and_resume(tensorflow_scripts):
    run = tensorflow_scripts.check("keras")
    assert final_accuracy(run) >= 0.95
    assert run.files() == ["ckpt.json", "ckpt.keras"]

    # Resuming with one more epoch runs just that epoch (Keras numbers epochs from 1).
    run = tensorflow_scripts.check("keras-resume")
    out, epochs = run.output(), KERAS_EPOCHS
    assert f"Epoch {epochs + 1}/{epochs + 1}" in out and f"Epoch {epochs}/" not in out, out
    assert final_accuracy(run) >= 0.95
    assert run.files() == ["ckpt.json", "ckpt.keras"]
    assert json.loads((run.cwd / "ckpt.json").read_text())["epoch"] == epochs + 1


@pytest.mark.timeout(TF_TIMEOUT + 60)
def test_tf2_custom_loop_example_and_resume(tensorflow_scripts):
    run, epochs = tensorflow_scripts.check("tf2"), TF2_EPOCHS
    assert final_accuracy(run) >= 0.95
    assert f"epoch {epochs}/{epochs}:" in run.output(), run.output()
    assert run.files() == ["ckpt.pkl"]

    # --resume with one more epoch continues from the checkpoint: that epoch only.
    run = tensorflow_scripts.check("tf2-resume")
    epochs_run = re.findall(r"^epoch (\d+)/", run.output(), re.M)
    assert epochs_run == [str(epochs + 1)], run.output()
    assert final_accuracy(run) >= 0.95
    assert run.files() == ["ckpt.pkl"]


@pytest.mark.timeout(TF_TIMEOUT + 60)
def test_tf1_monitored_session_example(tensorflow_scripts):
    run = tensorflow_scripts.check("tf1")
    assert final_accuracy(run) >= 0.93
    last = re.search(r"training steps 0 to (\d+) on 2 rank", run.output())
    assert last, run.output()
    # Rank 0 alone writes: TensorFlow's checkpoint files, and no temporary ones.
    allowed = re.compile(r"checkpoint|graph\.pbtxt|events\.out\.tfevents\.[\w.-]+|"
                         r"model\.ckpt-\d+\.(index|meta|data-\d{5}-of-\d{5})")
    names = run.files()
    assert all(allowed.fullmatch(n) for n in names), names
    assert f"model.ckpt-{last[1]}.index" in names, names
    state = (run.cwd / "checkpoint").read_text()
    assert re.match(rf'model_checkpoint_path: "[^"]*model\.ckpt-{last[1]}"\n', state), state
