"""ringreduce.spark.run on a real Spark (pyspark from PyPI): one Spark application
(tests/workers/spark_driver.py) runs every case, each test reads its line.

Where network namespaces can be made (root), the application runs on a standalone cluster
whose two workers are two hosts (tests/netns.py), 2 task slots each, so ranks of a job
land on both hosts (shared memory inside one, TCP across) and meet at the executor
address Spark reports; elsewhere on ``local[4,3]``. Everything runs under tests/procs.py,
which kills the driver, the JVMs and the Python workers at the timeout or after. The pure
parts of the world's formation are tested in one process (tests/test_task_world.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
from procs import PYTHON, WORKERS, base_env, run_procs

pytest.importorskip("pyspark", reason="pyspark is not installed (the test extra has it)")

pytestmark = [pytest.mark.timeout(660),
              pytest.mark.skipif(shutil.which("java") is None,
                                 reason="Spark needs a Java runtime (java not on PATH)")]


_CLUSTER = """
set -u
run() {{ ns=$1 addr=$2; shift 2; ip netns exec "$ns" env SPARK_LOCAL_IP="$addr" \\
    RINGREDUCE_HOST_ID="$ns" "$@"; }}
run {ns0} {a0} {sc} org.apache.spark.deploy.master.Master --host {a0} --port 7077 \\
    --webui-port 0 &
sleep 2
for h in "{ns0} {a0}" "{ns1} {a1}"; do
    set -- $h
    run $1 $2 {sc} org.apache.spark.deploy.worker.Worker spark://{a0}:7077 --host $2 \\
        --cores 2 --memory 1g --webui-port 0 &
done
run {ns0} {a0} {python} {driver} spark://{a0}:7077 {a0}
"""


# Every JVM here lives a minute: the C1 compiler alone and the serial collector cost a third
# less CPU than the server defaults (138 -> 92 CPU-seconds for this module on 2 cores)
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC -XX:-UsePerfData"


def _two_hosts(stack: contextlib.ExitStack) -> Optional[Any]:
    """Two namespace hosts, or None where they cannot be made here."""
    if os.geteuid() != 0:
        return None
    from netns import Hosts

    try:
        return stack.enter_context(Hosts(2))
    except pytest.skip.Exception:
        return None


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("spark")
    env = base_env({"PYSPARK_PYTHON": PYTHON, "SPARK_WORKER_DIR": log_dir / "work",
                    "SPARK_LOG_DIR": log_dir / "logs", "SPARK_DAEMON_JAVA_OPTS": JVM_OPTIONS},
                   log_dir)
    driver = WORKERS / "spark_driver.py"
    with contextlib.ExitStack() as stack:
        hosts = _two_hosts(stack)
        if hosts is None:
            cmd = [PYTHON, str(driver)]
        else:
            import pyspark

            cmd = ["bash", "-c", _CLUSTER.format(
                ns0=hosts.names[0], ns1=hosts.names[1], a0=hosts.addrs[0], a1=hosts.addrs[1],
                sc=Path(pyspark.__file__).parent / "bin" / "spark-class", python=PYTHON,
                driver=driver)]
        # ~115 s on a quiet 2-core VM (the estimators' fits are most of it); its slow state
        # runs 2-3x longer
        job = run_procs([("spark driver", cmd, env)], 600, log_dir)
    proc = job.procs[0]
    assert not job.timed_out, f"the Spark driver hit its timeout\n{job.describe()}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out = {c["case"]: c for c in lines}
    assert proc.returncode == 0 and "zero" in out, job.describe()
    # e.g. Lightning's log handler bound to an earlier task's (closed) relayed stderr
    out["logging_errors"] = (proc.stdout + proc.stderr).count("--- Logging error ---")
    out["hosts"] = hosts and hosts.names
    return out


def value(case: dict):
    assert "error" not in case, case.get("traceback")
    return case["value"]


def check_grouped(ranks: list, hosts: Optional[list]) -> None:
    """Ranks in order, a host's ranks consecutive with local ranks 0..k-1, cross ranks
    counting the hosts; on two hosts, both used."""
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    where = [r["host"] for r in ranks]
    order = list(dict.fromkeys(where))
    assert where == sorted(where, key=order.index), where
    for r in ranks:
        same = [q for q in ranks if q["host"] == r["host"]]
        assert r["local_size"] == len(same) and r["local_rank"] == same.index(r)
        assert r["cross"] == [order.index(r["host"]), len(order)]
    if hosts is not None:
        assert sorted(order) == sorted(hosts)
    assert len({r["pid"] for r in ranks}) == len(ranks)


def test_ranks_and_allreduce(cases):
    got = value(cases["allreduce"])
    check_grouped(got, cases["hosts"])
    assert {r["size"] for r in got} == {3}
    # (1 + 2 + 3) / 3 * 2.0 on every rank, in rank order
    assert all(r["avg"] == [4.0] * 4 for r in got)


def test_every_slot_on_both_hosts(cases):
    got = value(cases["four"])
    check_grouped(got, cases["hosts"])
    assert all(r["avg"] == [2.5] * 4 for r in got)
    if cases["hosts"] is not None:
        assert [r["local_size"] for r in got] == [2] * 4


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


def test_elastic_job_grows_back_after_a_crashed_task(cases):
    got = cases["elastic"]
    values = value(got)  # 3 ranks; the last one's Python worker dies at epoch 3
    assert [v["rank"] for v in values] == [0, 1, 2]
    sizes = values[0]["sizes"]
    assert all(v["sizes"] == sizes and v["total"] == values[0]["total"] for v in values)
    # 3 ranks for epochs 0-2; 2 while Spark retries the task; 3 again once its new attempt
    # registered (a new host) and the members took it in at a commit
    assert sizes[:3] == [3, 3, 3] and sizes[3] == 2 and sizes[-6:] == [3] * 6, sizes
    assert values[0]["total"] == sum(sizes)  # the broken epoch rolled back, none lost
    assert "[w1]: trained " in got["stdout"] and "[w4]: trained " in got["stdout"]
    if cases["hosts"] is not None:  # the standalone cluster: tasks on both hosts
        assert len({v["host"] for v in values}) == 2


def test_elastic_error_everywhere_is_raised(cases):
    got = cases["elastic_failing"]
    assert got["error"] == "ValueError" and got["message"].startswith("bad batch on rank ")
    assert "ringreduce.spark.run_elastic: rank " in got["cause"]


def test_usage_errors(cases):
    assert cases["no_context"]["error"] == "InvalidInputError"
    assert "no active SparkContext" in cases["no_context"]["message"]
    assert cases["mpi_args"]["error"] == "InvalidInputError"
    assert "extra_mpi_args" in cases["mpi_args"]["message"]
    assert cases["zero"]["error"] == "InvalidInputError"



def test_torch_estimator_trains_resumes_and_transforms(cases):
    got = value(cases["torch_estimator"])
    # 2 ranks, each on its own share of the store's parts, gradients averaged every step:
    # the weights are where plain float64 SGD over the same shares ends (float32 here)
    assert got["replay_diff"] < 1e-5, got
    loss, val = got["history"]["loss"], got["history"]["val_loss"]
    assert len(loss) == len(val) == 3 and loss[2] < loss[0] / 50 and val[2] < val[0] / 50
    # the same run_id with epochs=5: resumed after epoch 2 from rank 0's checkpoint
    resumed = got["resumed"]
    assert resumed["loss"][:3] == loss and len(resumed["loss"]) == 5, resumed
    assert resumed["loss"][4] < loss[2]
    # the same DataFrame object: its parts were not written again, so the resumed epochs
    # ran on the same shares and the 5 epochs end where the replay's 5 do
    assert got["reused"] and got["resumed_diff"] < 1e-5, got
    assert got["checkpoint"] == ["checkpoint.pkl"]
    # transform: every row, its columns kept, the prediction the driver's model gives
    assert got["rows"] == 240 and got["columns"][-1] == "y__output"
    assert got["transform_diff"] < 1e-6
    # backward_passes_per_step=2 with batches of 4: the replay's steps of 8 rows
    assert got["halves_diff"] < 1e-5, got
    # the run's checkpoint is of another model: refused naming the run, on every rank
    assert got["mismatch"][0] == "InvalidInputError", got["mismatch"]
    assert "run_id 'lin' has a checkpoint" in got["mismatch"][1]
    # saved and loaded, alone and in a PipelineModel: the same predictions, history, uid
    assert got["saved"] == {"diff": 0.0, "class": "TorchModel", "uid": True, "history": True}


def test_torch_estimator_vector_labels_weights_and_refusals(cases):
    got = value(cases["torch_estimator_vector"])
    assert len(got["history"]["val_loss"]) == 2
    assert got["history"]["loss"][1] < got["history"]["loss"][0]
    assert (got["output_type"], got["output_size"]) == ("DenseVector", 2)
    # train_minibatch_fn: a step that never steps; the loss is still measured and reported
    assert got["custom_step_moved"] == 0.0 and len(got["custom_step_loss"]) == 1
    assert got["missing"][0] == "InvalidInputError" and "'nope'" in got["missing"][1]
    assert got["too_few_rows"][0] == "InvalidInputError"
    assert "would get no rows" in got["too_few_rows"][1]
    # (counted in the training rows, written first: the validation fraction holds the rest)
    assert got["nulls"][0] == "InvalidInputError" and "'y2' holds " in got["nulls"][1]
    assert "null(s): fill or drop them" in got["nulls"][1]
    assert got["lengths"][0] == "InvalidInputError"
    assert "'y2' holds vectors of different lengths (1, 2)" in got["lengths"][1]
    assert got["null_flag_rows"] == [192, 48]  # a null validation flag is a training row


def test_lightning_estimator_trains_resumes_and_transforms(cases):
    pytest.importorskip("lightning")
    got = value(cases["lightning_estimator"])
    # a Lightning Trainer per rank on the same shares and steps as TorchEstimator's: the
    # replay's weights (float32); the history is what the module logged with sync_dist
    assert got["replay_diff"] < 1e-5, got
    loss, val = got["history"]["train_loss"], got["history"]["val_loss"]
    assert len(loss) == len(val) == 3 and val[2] < val[0] / 50, got["history"]
    # the same run_id with epochs=5 resumes from Lightning's checkpoint after epoch 2
    resumed = got["resumed"]
    assert resumed["val_loss"][:3] == val and len(resumed["val_loss"]) == 5, resumed
    assert resumed["val_loss"][4] < val[2]
    # the user's ModelCheckpoint wrote into the store's run directory
    assert got["best"] == ["best.ckpt"], got["best"]
    assert got["transform_diff"] < 1e-6
    assert got["saved"] == {"diff": 0.0, "class": "TorchModel", "uid": True, "history": True}
    assert got["plain"][0] == "InvalidInputError" and "ringreduce.spark.torch" in got["plain"][1]
    assert got["mismatch"][0] == "InvalidInputError", got["mismatch"]
    assert "run_id 'lit' has a checkpoint" in got["mismatch"][1]
    assert got["foreign"][0] == "InvalidInputError", got["foreign"]  # a TorchEstimator's
    assert "run_id 'foreign' has a checkpoint" in got["foreign"][1]
    # what the module logs in its own on_train_epoch_end is that epoch's, resumed or not
    assert got["history"]["epoch_end"] == [0.0, 1.0, 2.0], got["history"]
    assert got["resumed"]["epoch_end"] == [0.0, 1.0, 2.0, 3.0, 4.0], got["resumed"]
    assert cases["logging_errors"] == 0  # Lightning logs to the task's stream


def test_keras_estimator_trains_resumes_and_transforms(cases):
    got = value(cases["keras_estimator"])
    assert got["replay_diff"] < 1e-5, got  # the same plain SGD replay as the torch case
    hist = got["history"]
    assert set(hist) == {"loss", "mae", "val_loss", "val_mae"}, hist
    assert all(len(v) == 3 for v in hist.values()) and hist["loss"][2] < hist["loss"][0] / 50
    resumed = got["resumed"]
    assert all(resumed[k][:3] == hist[k] and len(resumed[k]) == 5 for k in hist), resumed
    assert got["rows"] == 240 and got["transform_diff"] < 1e-6
    # (its custom_objects hold a lambda: saved by value)
    assert got["saved"] == {"diff": 0.0, "class": "KerasModel", "uid": True, "history": True}
    # backward_passes_per_step=2 (the mean of 2), and checkpoint_callback=
    # BestModelCheckpoint(mode="max"): the model of the first epoch, not the last
    assert got["halves_diff"] < 1e-5, got
    assert got["halves_worst"] == 0 and got["halves_last_diff"] > 1e-3, got


def test_estimator_example_trains(cases):
    """examples/spark_estimator.py: TorchEstimator on the digits DataFrame, 5 epochs."""
    got = value(cases["estimator_example"])
    assert len(got["history"]["val_accuracy"]) == 5
    assert got["history"]["val_accuracy"][-1] > 0.9 and got["test_accuracy"] > 0.9, got
