"""ringreduce.spark.run on a real Spark (local[4], pyspark from PyPI): one Spark
application (tests/workers/spark_driver.py) runs every case, each test reads its line.
The driver runs under tests/procs.py, which kills it, its JVM and the Python workers at
the timeout or after; the pure parts of the world's formation are tested in one process
(tests/test_task_world.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from procs import PYTHON, WORKERS, base_env, run_procs

pytest.importorskip("pyspark", reason="pyspark is not installed (the test extra has it)")

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("java") is None,
                                 reason="Spark needs a Java runtime (java not on PATH)")]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("spark")
    job = run_procs([("spark driver", [PYTHON, str(WORKERS / "spark_driver.py")],
                      base_env({"PYSPARK_PYTHON": PYTHON}, log_dir))], 240, log_dir)
    proc = job.procs[0]
    assert not job.timed_out, f"the Spark driver hit its timeout\n{job.describe()}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out = {c["case"]: c for c in lines}
    assert proc.returncode == 0 and "zero" in out, job.describe()
    return out


def value(case: dict):
    assert "error" not in case, case.get("traceback")
    return case["value"]


def test_ranks_and_allreduce(cases):
    got = value(cases["allreduce"])
    assert [r["rank"] for r in got] == [0, 1, 2]
    assert {(r["size"], r["local_size"]) for r in got} == {(3, 3)}
    assert sorted(r["local_rank"] for r in got) == [0, 1, 2]
    # (1 + 2 + 3) / 3 * 2.0 on every rank, in rank order
    assert all(r["avg"] == [4.0] * 4 for r in got)
    assert len({r["pid"] for r in got}) == 3


def test_num_proc_defaults_to_default_parallelism(cases):
    assert value(cases["default_num_proc"]) == 4


def test_task_environment_restored(cases):
    # The Python workers are reused by later tasks: nothing of the job stays behind.
    assert value(cases["environ_after"]) == [[None, None, None]] * 4


def test_output_reaches_the_driver_prefixed(cases):
    case = cases["output"]
    assert value(case) == [0, 1]
    assert sorted(case["stdout"].splitlines()) == ["[0]: hello from rank 0",
                                                   "[1]: hello from rank 1"]
    assert sorted(case["stderr"].splitlines()) == ["[0]: warning from rank 0",
                                                   "[1]: warning from rank 1"]


def test_output_with_timestamps(cases):
    lines = cases["output_stamped"]["stdout"].splitlines()
    assert len(lines) == 2
    for line in lines:
        head, _, text = line.partition("[")
        assert len(head.split()) == 5 and text.endswith(f"hello from rank {text[0]}")


def test_torch_distributed_optimizer(cases):
    params = value(cases["torch"])
    assert len(params) == 2 and params[0] == params[1]


def test_failure_is_the_failing_ranks_error_not_a_hang(cases):
    case = cases["failing"]
    assert case["error"] == "ValueError" and case["message"] == "bad batch on rank 1"
    assert "rank 1 raised" in case["cause"] and "failing_fn" in case["cause"]
    assert case["seconds"] < 30


def test_usable_after_a_failure(cases):
    assert [r["avg"] for r in value(cases["after_failure"])] == [[1.5] * 4] * 2


def test_dead_worker_names_its_task(cases):
    case = cases["dying"]
    assert case["error"] == "RingReduceError"
    assert "partition 1" in case["message"] and "crashed" in case["message"]
    assert case["seconds"] < 60


def test_example_trains(cases):
    """examples/spark_train.py: pytorch_train's main as 2 Spark ranks, 3 epochs."""
    got = value(cases["example"])
    assert len(got["accuracies"]) == 2 and got["accuracies"][0] == got["accuracies"][1]
    assert got["accuracies"][0] > 0.9
    assert got["files"] == ["ckpt.pt"]


def test_horovod_runner(cases):
    # np > 0: Spark tasks; np < 0: processes on the driver; rank 0's value either way
    assert value(cases["runner_spark"]) == [0, 2, [4.0, 4.0]]
    assert value(cases["runner_local"]) == [0, 3, [3.0, 3.0]]
    assert cases["runner_bad_np"]["error"] == "InvalidInputError"


def test_usage_errors(cases):
    assert cases["no_context"]["error"] == "InvalidInputError"
    assert "no active SparkContext" in cases["no_context"]["message"]
    assert cases["mpi_args"]["error"] == "InvalidInputError"
    assert "extra_mpi_args" in cases["mpi_args"]["message"]
    assert cases["zero"]["error"] == "InvalidInputError"
