"""Several scripts in one ``mpirun`` job (tests/workers/run_scripts.py).

Every TensorFlow process costs ~10 CPU-seconds of imports, most of the example tests'
time: the scripts share a job, one after another in each rank's process, each with its
own ``sys.argv``, working directory and output files. ``tensorflow_job`` is the one job
of the TensorFlow examples, Horovod's and ours (conftest.py's session fixture
``tensorflow_scripts``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from procs import ROOT, WORKERS, Job, run_mpi


@dataclass
class Script:
    """One script of a job: what to run, where, and (once run) what rank 0 printed."""

    label: str
    script: Path
    args: Sequence[object]
    cwd: Path
    fails: bool = False  # expected to raise on every rank (its errors: ``errors(rank)``)
    prefix: Path = Path()

    def output(self, rank: int = 0) -> str:
        """What the script wrote to ``sys.stdout`` on ``rank``."""
        return _read(self._path(f"{rank}.out"))

    def errors(self, rank: int = 0) -> str:
        return _read(self._path(f"{rank}.err"))

    def _path(self, suffix: str) -> Path:
        """One of the files run_scripts.py writes for this script: ``<prefix>.<suffix>``."""
        return self.prefix.with_name(f"{self.prefix.name}.{suffix}")

    def files(self) -> list[str]:
        """The files in its working directory once it ended (rank 0's view)."""
        return sorted(self.digests())

    def digests(self) -> dict[str, str | None]:
        """Those files' SHA-256 by name (a directory's: None)."""
        path = self._path("files")
        return json.loads(path.read_text()) if path.exists() else {}


def final_accuracy(run: Script) -> float:
    """The accuracy an example printed at its end, on rank 0 alone."""
    found = re.findall(r"final test accuracy: ([0-9.]+)", run.output())
    assert len(found) == 1, f"expected one accuracy line (from rank 0)\n{run.output()}"
    assert "final test accuracy" not in run.output(1), run.output(1)
    return float(found[0])


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else f"(no {path.name})"


@dataclass
class ScriptJob:
    job: Job
    scripts: dict[str, Script]

    def check(self, label: str, ranks: int = 2) -> Script:
        """The script ``label``, after asserting that the job (and so every script before
        and after it) ended well; otherwise every rank's errors of every script."""
        try:
            self.job.check_ok()
        except AssertionError as err:
            errors = "\n".join(f"--- {s.label}, rank {r}, stderr:\n{s.errors(r)[-3000:]}"
                               for s in self.scripts.values() for r in range(ranks))
            raise AssertionError(f"the scripts' job failed: {err}\n{errors}") from None
        return self.scripts[label]


def run_scripts(np_: int, scripts: Sequence[Script], workdir: Path,
                env: Mapping[str, object], timeout: float) -> ScriptJob:
    """Run ``scripts`` in order in one ``mpirun -np np_`` job; outputs go to ``workdir``."""
    for s in scripts:
        s.prefix = workdir / s.label
        s.cwd.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    spec.write_text(json.dumps([{"script": str(s.script), "args": [str(a) for a in s.args],
                                 "cwd": str(s.cwd), "out": str(s.prefix), "fails": s.fails}
                                for s in scripts]))
    job = run_mpi(np_, WORKERS / "run_scripts.py", [spec], env=env, timeout=timeout)
    return ScriptJob(job, {s.label: s for s in scripts})


TF_ENV = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
TF_TIMEOUT = 600  # seconds for the nine; they take ~90 s on the 2-core VM
KERAS_EPOCHS, TF2_EPOCHS = 10, 8  # our Keras and custom-loop examples


def tensorflow_job(work: Path) -> ScriptJob:
    """The TensorFlow examples, the two TF1 graph ones last (they leave eager execution).
    Test workers stay out: they change process-wide settings (Keras' floatx) for their
    checks, which the examples would inherit."""
    examples, horovod = ROOT / "examples", ROOT / "examples" / "horovod"
    keras_dir, tf2_dir = work / "keras-ckpt", work / "tf2-ckpt"
    keras = ["--epochs", KERAS_EPOCHS, "--checkpoint-dir", keras_dir]
    tf2 = ["--epochs", TF2_EPOCHS, "--checkpoint-dir", tf2_dir]
    scripts = [
        Script("hvd-keras", horovod / "tensorflow2_keras_mnist.py", [], work / "hvd-keras"),
        Script("hvd-tf2", horovod / "tensorflow2_mnist.py", [], work / "hvd-tf2"),
        Script("hvd-synthetic", horovod / "tensorflow2_synthetic_benchmark.py",
               ["--fp16-allreduce", "--num-iters", 2, "--num-batches-per-iter", 1,
                "--num-warmup-batches", 1, "--batch-size", 4], work / "hvd-synthetic"),
        Script("keras", examples / "keras_train.py", keras, keras_dir),
        Script("tf2", examples / "tf2_custom_loop.py", tf2, tf2_dir),
        Script("keras-resume", examples / "keras_train.py",
               ["--epochs", KERAS_EPOCHS + 1, *keras[2:], "--resume"], keras_dir),
        Script("tf2-resume", examples / "tf2_custom_loop.py",
               ["--epochs", TF2_EPOCHS + 1, *tf2[2:], "--resume"], tf2_dir),
        Script("tf1", examples / "tf1_monitored_session.py",
               ["--checkpoint-dir", work / "tf1-ckpt"], work / "tf1-ckpt"),
        # last: tf.disable_v2_behavior() also turns off resource variables, for good
        Script("hvd-tf1", horovod / "tensorflow_mnist.py", ["--use-adasum"], work / "hvd-tf1"),
    ]
    return run_scripts(2, scripts, work, TF_ENV, TF_TIMEOUT)
