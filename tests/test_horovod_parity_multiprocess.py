"""Horovod parity under real mpirun: the parity worker at 3 ranks, and Horovod's own
PyTorch examples (digits instead of MNIST; the synthetic benchmark) with only the import
changed, Adasum included."""

from __future__ import annotations

import json
import re

import pytest
from procs import ROOT, run_mpi

pytest.importorskip("torch")

EXAMPLES = ROOT / "examples" / "horovod"


def test_parity_worker_three_ranks(tmp_path):
    trace = tmp_path / "timeline.json"
    job = run_mpi(3, "parity_worker.py", [trace], timeout=120)
    job.check_ok(expect_ranks=3)
    rows = {e["args"]["name"] for e in json.loads(trace.read_text())
            if e.get("name") == "thread_name"}
    assert {"ga.0", "ga.1"} <= rows, rows


@pytest.mark.parametrize("flags", [[], ["--use-adasum", "--fp16-allreduce"]],
                         ids=["average", "adasum-fp16"])
def test_horovod_mnist_example(flags):
    pytest.importorskip("sklearn")
    job = run_mpi(2, EXAMPLES / "pytorch_mnist.py", ["--epochs", 8, *flags], timeout=180)
    job.check_ok()
    found = re.findall(r"final test accuracy: ([0-9.]+)", job.procs[0].stdout)
    assert len(found) == 1 and float(found[0]) >= 0.9, job.describe()


def test_horovod_synthetic_benchmark_with_adasum():
    job = run_mpi(2, EXAMPLES / "pytorch_synthetic_benchmark.py",
                  ["--use-adasum", "--num-iters", 2, "--num-batches-per-iter", 1,
                   "--batch-size", 4], timeout=120)
    job.check_ok()
    assert re.search(r"Total img/sec on 2 CPU\(s\): [0-9.]+", job.procs[0].stdout), \
        job.describe()
