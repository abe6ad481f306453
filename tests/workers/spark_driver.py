"""One Spark application running every case of tests/test_spark.py in turn: Spark's JVMs
take seconds to start, so the cases share them. ``spark_driver.py`` runs on ``local[4]``;
``spark_driver.py MASTER_URL DRIVER_ADDRESS`` joins a standalone cluster (two hosts of
4 task slots in all, see tests/test_spark.py) once both executors have registered.
Prints one JSON line per case (``{"case": name, ...}``); a case that raises prints its
error instead of stopping the rest.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np


def allreduce_fn(scale):
    import ringreduce as rr

    rr.init()
    got = rr.allreduce(np.full(4, float(rr.rank() + 1)) * scale, op=rr.Average)
    return {"rank": rr.rank(), "size": rr.size(), "local_rank": rr.local_rank(),
            "local_size": rr.local_size(), "cross": [rr.cross_rank(), rr.cross_size()],
            "avg": got.tolist(), "pid": os.getpid(),
            "host": os.environ.get("RINGREDUCE_HOST_ID")}


def torch_fn():
    import torch

    import ringreduce.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights: the broadcast must fix them
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(3):
        x = torch.full((4, 3), float(hvd.rank() + step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return [p.detach().numpy().tolist() for p in model.parameters()]


def failing_fn():
    import ringreduce as rr

    rr.init()
    if rr.rank() == 1:
        time.sleep(0.5)  # rank 0 is inside the allreduce by then
        raise ValueError("bad batch on rank 1")
    rr.allreduce(np.ones(8))
    return "unreachable"


def dying_fn():
    import ringreduce as rr

    rr.init()
    if rr.rank() == 1:
        os._exit(3)
    rr.allreduce(np.ones(8))
    return "unreachable"


def printing_fn():
    import ringreduce as rr

    rr.init()
    print(f"hello from rank {rr.rank()}")
    print(f"warning from rank {rr.rank()}", file=sys.stderr)
    return rr.rank()


def captured(**kw):
    import io

    import ringreduce.spark as rs

    out, err = io.StringIO(), io.StringIO()
    value = rs.run(printing_fn, num_proc=2, stdout=out, stderr=err, **kw)
    return {"value": value, "stdout": out.getvalue(), "stderr": err.getvalue()}


def runner_fn(scale=1.0):
    import ringreduce as rr

    rr.init()
    return (rr.rank(), rr.size(), rr.allreduce(np.ones(2) * scale, op=rr.Sum).tolist())


def elastic_fn(die_at=None):
    """An elastic job: epochs of one allreduce, committed, until the world has had 3 ranks
    for 6 epochs after having had 2 (or 200 epochs); with ``die_at=(epoch, size)`` the
    last rank's Python worker dies there (Spark retries its task)."""
    import ringreduce as rr

    rr.init()
    state = rr.elastic.ObjectState(epoch=0, total=0.0, sizes=[])

    @rr.elastic.run
    def loop(state):
        while state.epoch < 200 and not (2 in state.sizes and state.sizes[-6:] == [3] * 6):
            if die_at == (state.epoch, rr.size()) and rr.rank() == rr.size() - 1:
                os._exit(3)
            state.total += float(rr.allreduce(np.ones(2), op=rr.Sum)[0])
            state.sizes = state.sizes + [rr.size()]
            state.epoch += 1
            time.sleep(0.05)
            state.commit()
        print(f"trained {state.epoch} epochs")
        return {"rank": rr.rank(), "total": state.total, "sizes": state.sizes,
                "host": os.environ.get("RINGREDUCE_HOST_ID")}

    return loop(state)


def elastic_failing_fn():
    import ringreduce as rr

    rr.init()
    raise ValueError(f"bad batch on rank {rr.rank()}")


def elastic_case():
    import io

    import ringreduce.spark as rs

    out = io.StringIO()
    value = rs.run_elastic(elastic_fn, args=((3, 3),), num_proc=3, min_num_proc=2,
                           elastic_timeout=60, stdout=out)
    return {"value": value, "stdout": out.getvalue()}


def environ_fn(_):
    return [os.environ.get(k) for k in ("RANK", "MASTER_PORT", "RINGREDUCE_SECRET")]


def example_module(name):
    """An example script of examples/ as a module; its main joins this session."""
    import importlib
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    return importlib.import_module(name)


def example(sc):
    """examples/spark_train.py in this session (getOrCreate joins it), 3 epochs."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        accuracies = example_module("spark_train").main(["--num-proc", "2", "--epochs", "3",
                                       "--checkpoint-dir", tmp])
        return {"accuracies": accuracies, "files": sorted(os.listdir(tmp))}


def case(name, body):
    start = time.monotonic()
    try:
        out = body()
    except BaseException as e:
        out = {"error": type(e).__name__, "message": str(e),
               "cause": str(e.__cause__) if e.__cause__ else None,
               "traceback": traceback.format_exc()}
    out = {"case": name, "seconds": round(time.monotonic() - start, 2), **out}
    print(json.dumps(out, default=str), flush=True)


# The daemons' options (tests/test_spark.py sets them) for the driver and executor JVMs too
JVM_OPTIONS = os.environ.get("SPARK_DAEMON_JAVA_OPTS", "")


def session(argv):
    """local[4], or the standalone cluster at argv[0] with the driver at argv[1]."""
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.appName("ringreduce-tests")
               .config("spark.ui.enabled", "false").config("spark.driver.memory", "1g")
               .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
               .config("spark.executor.extraJavaOptions", JVM_OPTIONS))
    if not argv:
        return builder.master("local[4,3]").getOrCreate()  # 3 attempts a task, as a cluster
    spark = (builder.master(argv[0]).config("spark.driver.host", argv[1])
             .config("spark.driver.bindAddress", argv[1])
             .config("spark.executor.memory", "512m")
             .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
             .getOrCreate())
    deadline = time.monotonic() + 90
    while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3:  # driver + 2
        if time.monotonic() > deadline:
            raise SystemExit("the two executors did not register within 90 s")
        time.sleep(0.5)
    return spark


def main():
    import ringreduce.spark as rs

    case("no_context", lambda: {"value": rs.run(allreduce_fn, args=(1.0,), num_proc=2)})
    spark = session(sys.argv[1:])
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    case("allreduce", lambda: {"value": rs.run(allreduce_fn, args=(2.0,), num_proc=3)})
    case("four", lambda: {"value": rs.run(allreduce_fn, args=(1.0,), num_proc=4)})
    case("default_num_proc", lambda: {"value": len(rs.run(allreduce_fn, args=(1.0,)))})
    case("environ_after", lambda: {"value": sc.parallelize(range(4), 4)
                                   .map(environ_fn).collect()})
    case("output", captured)
    case("output_stamped", lambda: captured(prefix_output_with_timestamp=True))
    case("torch", lambda: {"value": rs.run(torch_fn, num_proc=2)})
    case("failing", lambda: {"value": rs.run(failing_fn, num_proc=2)})
    case("after_failure", lambda: {"value": rs.run(allreduce_fn, args=(1.0,), num_proc=2)})
    case("dying", lambda: {"value": rs.run(dying_fn, num_proc=2)})
    case("example", lambda: {"value": example(sc)})
    case("runner_spark", lambda: {"value": rs.HorovodRunner(np=2).run(runner_fn, scale=2.0)})
    case("runner_local", lambda: {"value": rs.HorovodRunner(np=-3).run(runner_fn)})
    case("runner_bad_np", lambda: {"value": rs.HorovodRunner(np="2")})
    case("mpi_args", lambda: {"value": rs.run(allreduce_fn, args=(1.0,), num_proc=2,
                                              extra_mpi_args="-x FOO")})
    case("elastic", elastic_case)
    case("elastic_failing", lambda: {"value": rs.run_elastic(elastic_failing_fn, num_proc=2)})
    case("zero", lambda: {"value": rs.run(allreduce_fn, args=(1.0,), num_proc=0)})
    estimators(spark)
    spark.stop()


def estimators(spark):
    """The Spark ML estimators' cases; their module goes to the executors as a user's would
    (its loss functions are pickled by reference)."""
    import spark_estimators as est

    spark.sparkContext.addPyFile(est.__file__)
    case("torch_estimator", lambda: {"value": est.torch_estimator(spark)})
    case("torch_estimator_vector", lambda: {"value": est.torch_estimator_vector(spark)})
    case("keras_estimator", lambda: {"value": est.keras_estimator(spark)})
    case("lightning_estimator", lambda: {"value": est.lightning_estimator(spark)})
    case("estimator_example", lambda: {"value": estimator_example()})


def estimator_example():
    """examples/spark_estimator.py in this session (getOrCreate joins it), 5 epochs."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return example_module("spark_estimator").main(["--num-proc", "2", "--epochs", "5",
                                                       "--store", tmp])


if __name__ == "__main__":
    sys.exit(main())
