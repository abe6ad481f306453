"""Horovod parity under real mpirun: the parity worker at 3 ranks (Horovod's own PyTorch
examples: tests/test_torch_examples.py)."""

from __future__ import annotations

import json

import pytest
from procs import run_mpi

pytest.importorskip("torch")


def test_parity_worker_three_ranks(tmp_path):
    trace = tmp_path / "timeline.json"
    job = run_mpi(3, "parity_worker.py", [trace], timeout=120)
    job.check_ok(expect_ranks=3)
    rows = {e["args"]["name"] for e in json.loads(trace.read_text())
            if e.get("name") == "thread_name"}
    assert {"ga.0", "ga.1"} <= rows, rows
