"""``ringreduce.spark``: Horovod's ``horovod.spark.run`` on a Spark cluster.

``run(fn, num_proc=N)`` runs ``fn`` as N ranks inside one barrier stage of N Spark tasks and
returns what each rank returned, in rank order::

    import ringreduce.spark
    def train(lr):
        import ringreduce.torch as hvd
        hvd.init()
        ...
        return model.state_dict()
    states = ringreduce.spark.run(train, args=(0.1,), num_proc=4)

How a job runs (``ringreduce/_task_world.py`` states the protocol shared with Ray): the
stage runs in barrier mode, so Spark starts all N tasks together or none. Each task
describes itself (host identity, its executor's address, a free port) and
``BarrierTaskContext.allGather`` gives every task the same list; from it each task takes
its rank (a host's tasks consecutive), sets the env-var launch in ``os.environ`` and calls
``fn`` in the task's own Python worker, where ``init()`` finds it. Whatever happens, the
task leaves the job (``shutdown()``) and restores the environment before the worker is
reused. A rank whose ``fn`` raises leaves at once, so its peers' collectives end in
``PeerLostError`` instead of a wait; every task still returns a record, the stage succeeds,
and the driver raises the root failure again. Only a worker that dies makes the stage
fail; Spark then kills the other tasks and, the stage being a barrier result stage, aborts
the job instead of retrying it, so the training never starts twice.

``run_elastic`` is Horovod's elastic variant: one task per worker in an ordinary stage,
Spark's task retries bringing failed workers back (``elastic.py`` states its protocol).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Callable, Optional, Union

from .. import _task_world as tw
from ..exceptions import InvalidInputError, RingReduceError
from .output import OutputRelay, relayed

__all__ = ["HorovodRunner", "run", "run_elastic"]

_WHAT = "ringreduce.spark.run"


class _Task:
    """The function each barrier task runs (pickled by Spark with ``fn`` inside)."""

    def __init__(self, call: tuple, env: Mapping[str, str], secret: str,
                 output: tuple[str, int]) -> None:
        self.call, self.env, self.secret, self.output = call, dict(env), secret, output

    def __call__(self, _partition: Any) -> Any:
        from pyspark import BarrierTaskContext

        from .. import shutdown

        ctx = BarrierTaskContext.get()
        index = ctx.partitionId()
        address = ctx.getTaskInfos()[index].address.rsplit(":", 1)[0].strip("[]")  # host:port
        mine = json.dumps(asdict(tw.describe(address)))
        workers = [tw.Worker(**json.loads(m)) for m in ctx.allGather(mine)]
        env = tw.world_env(workers, index, self.secret, self.env)
        saved = tw.set_environ(env)
        try:
            with relayed(self.output, self.secret, int(env["RANK"])):
                record = tw.call(*self.call)
        finally:
            shutdown()
            tw.restore_environ(saved)
        yield {**record, "rank": int(env["RANK"])}


def _spark_context() -> Any:
    try:
        from pyspark import SparkContext
    except ImportError as e:
        raise InvalidInputError(f"{_WHAT} needs pyspark (pip install pyspark)") from e
    sc = SparkContext._active_spark_context
    if sc is None:
        raise InvalidInputError(f"{_WHAT}: no active SparkContext; start one first "
                                "(SparkSession.builder.getOrCreate())")
    return sc


def run(fn: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None, num_proc: Optional[int] = None,
        start_timeout: Optional[float] = None, use_mpi: Optional[bool] = None,
        use_gloo: Optional[bool] = None, extra_mpi_args: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None, stdout: Any = None, stderr: Any = None,
        verbose: int = 1, nics: Union[None, str, Sequence[str]] = None,
        prefix_output_with_timestamp: bool = False, executable: Optional[str] = None) -> list:
    """Run ``fn(*args, **kwargs)`` as ``num_proc`` ranks in Spark tasks; return their values
    in rank order (Horovod's ``horovod.spark.run``).

    ``fn`` runs in the Python worker of each task of one barrier stage and must call
    ``ringreduce.init()`` (or a framework layer's ``init()``) itself; ``fn``, its
    arguments and its return value travel by Spark's pickling.

    Parameters
    ----------
    fn : callable
        The function of every rank.
    args, kwargs : optional
        Its arguments.
    num_proc : int, optional
        Number of ranks, one Spark task each (default the context's
        ``defaultParallelism``). Spark must have that many task slots free at once.
    start_timeout : float, optional
        Seconds the ranks wait for each other in ``init()`` (as ``ringrun
        --start-timeout``).
    env : mapping, optional
        Variables set in each task's environment while ``fn`` runs, over the executor's
        own and the driver's ``RINGREDUCE_*`` / ``HOROVOD_*`` variables.
    nics : str or list of str, optional
        The network interface to use (one).
    stdout, stderr : file-like, optional
        Where the ranks' ``sys.stdout`` / ``sys.stderr`` lines go, each prefixed
        ``[rank]: `` (default this process's ``sys.stdout`` / ``sys.stderr``); what C code
        writes to the file descriptors stays in the executor's log.
    prefix_output_with_timestamp : bool
        Each line starts with the time, as ``ringrun --prefix-output-with-timestamp``.
    verbose :
        Accepted and ignored.
    use_mpi, use_gloo :
        Accepted and ignored: ringreduce has its own transport (both true is refused).
    extra_mpi_args, executable :
        Refused when set: no mpirun underneath, and ``fn`` runs in Spark's Python worker.

    Returns
    -------
    list
        ``fn``'s return value on each rank, in rank order.

    Raises
    ------
    Exception
        The exception of the rank that failed first (not counting ranks that only lost
        it), with that rank's traceback text as its ``__cause__``; RingReduceError when a
        task's worker died or Spark could not run the stage.
    """
    refused = [name for name, value in (("extra_mpi_args", extra_mpi_args),
                                        ("executable", executable)) if value is not None]
    if refused:
        raise InvalidInputError(f"{_WHAT}: {', '.join(refused)} not supported (no mpirun "
                                "underneath; fn runs in the Spark task's Python worker)")
    if use_mpi and use_gloo:
        raise InvalidInputError(f"{_WHAT}: use_gloo and use_mpi cannot both be true")
    sc = _spark_context()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    if num_proc < 1:
        raise InvalidInputError(f"{_WHAT}: num_proc={num_proc}: need at least one rank")
    secret = tw.new_secret()
    relay = OutputRelay(sc.getConf().get("spark.driver.host"), secret,
                        stdout or sys.stdout, stderr or sys.stderr, prefix_output_with_timestamp)
    task = _Task((fn, tuple(args), dict(kwargs or {})),
                 tw.driver_env(start_timeout, nics, env), secret, relay.address)
    rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(task)
    try:
        blobs = rdd.collect()  # one record per task
    except Exception as e:
        raise RingReduceError(f"{_WHAT}: {_stage_failure(e, num_proc)}") from e
    finally:
        relay.close()
    records = sorted(blobs, key=lambda r: r["rank"])
    return tw.returned(records, _WHAT)


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (),
                kwargs: Optional[Mapping[str, Any]] = None, num_proc: Optional[int] = None,
                min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
                start_timeout: Optional[float] = None, elastic_timeout: Optional[float] = None,
                reset_limit: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                stdout: Any = None, stderr: Any = None, verbose: int = 1,
                nics: Union[None, str, Sequence[str]] = None,
                prefix_output_with_timestamp: bool = False, min_np: Optional[int] = None,
                max_np: Optional[int] = None) -> list:
    """Run ``fn(*args, **kwargs)`` as an elastic job in Spark tasks (Horovod's
    ``horovod.spark.run_elastic``); return the last generation's values in rank order.

    ``fn`` calls ``init()`` and wraps its training loop in ``ringreduce.elastic.run`` (or a
    framework layer's ``elastic.run``) with a state object, as under ``ringrun --min-np``.
    One Spark job of ``max_num_proc`` tasks runs; each task is a host of one slot, a
    task that fails is retried by Spark and comes back as a new host
    (``ringreduce/spark/elastic.py`` states the protocol).

    Parameters
    ----------
    fn, args, kwargs :
        The function of every rank and its arguments (pickled by Spark).
    num_proc : int, optional
        Workers to start with (default the context's ``defaultParallelism``).
    min_num_proc, max_num_proc : int, optional
        Fewest workers to train with and most, the number of Spark tasks (both default
        ``num_proc``); ``min_np`` / ``max_np`` are Horovod's older names.
    start_timeout : float, optional
        Seconds the ranks of a generation wait for each other when they connect.
    elastic_timeout : float, optional
        Seconds a new generation may take to form (default ``HOROVOD_ELASTIC_TIMEOUT`` or
        600, as ``ringrun --elastic-timeout``).
    reset_limit : int, optional
        End the job after this many resets.
    env, stdout, stderr, nics, prefix_output_with_timestamp :
        As for ``run``; output lines are prefixed with the worker's id (``[w3]: ``), as
        ``ringrun``'s elastic mode does.
    verbose :
        Accepted and ignored.

    Returns
    -------
    list
        ``fn``'s value on each rank of the last generation, in rank order.

    Raises
    ------
    Exception
        The last generation's error (its earliest rank that did not only lose a peer);
        RingReduceError with the driver's reason when it ended the job, or Spark's when
        the Spark job failed (a task failed more often than ``spark.task.maxFailures``).
    """
    from .._horovod_settings import elastic_timeout as default_elastic_timeout
    from ..elastic.driver import ElasticSettings
    from .elastic import run_job

    what = "ringreduce.spark.run_elastic"
    sc = _spark_context()
    num_proc = sc.defaultParallelism if num_proc is None else num_proc
    low = min_np if min_np is not None else min_num_proc
    high = max_np if max_np is not None else max_num_proc
    low, high = num_proc if low is None else low, num_proc if high is None else high
    if not 1 <= low <= num_proc <= high:
        raise InvalidInputError(f"{what}: need 1 <= min_num_proc ({low}) <= num_proc "
                                f"({num_proc}) <= max_num_proc ({high})")
    settings = ElasticSettings(low, high, num_proc, default_elastic_timeout(elastic_timeout),
                               reset_limit)
    return run_job(what, sc, fn, args, kwargs or {}, settings, high,
                   tw.driver_env(start_timeout, nics, env),
                   (stdout or sys.stdout, stderr or sys.stderr, prefix_output_with_timestamp))


def _stage_failure(e: BaseException, num_proc: int) -> str:
    """What Spark says of a failed stage, in one line: which partition's task failed and
    why (a Python worker that died, say), without the JVM's stacks."""
    text = str(e).strip()
    task = re.search(r"barrier task \w+\(\d+, (\d+)\)", text)
    where = f"the task of partition {task.group(1)}" if task else "a task"
    # Under the job's own line, the first "...Exception: reason" is the task's failure.
    why = re.search(r"^\S*(?:Exception|Error): (.+?)(?: Consider setting.*)?$",
                    text.split("\n", 2)[-1], re.M)
    reason = why.group(1).strip() if why else (text.splitlines() or [""])[-1]
    return f"{where} of the {num_proc}-task stage failed" + (f": {reason}" if reason else "")


class HorovodRunner:
    """Databricks' ``sparkdl.HorovodRunner`` over ringreduce: ``HorovodRunner(np=4)
    .run(train, lr=0.1)`` calls ``train(lr=0.1)`` on every rank and returns rank 0's value.

    Parameters
    ----------
    np : int
        Above 0: that many ranks in Spark tasks (``run`` above). Below 0: ``-np``
        processes on this machine, the driver (``ringreduce.run``), to try a job without
        the cluster. 0: every task slot (the context's ``defaultParallelism``).
    driver_log_verbosity : {"log_callback_only", "all"}
        Accepted; every rank's output comes back to the driver either way.
    """

    def __init__(self, *, np: int, driver_log_verbosity: str = "log_callback_only") -> None:
        if not isinstance(np, int) or isinstance(np, bool):
            raise InvalidInputError(f"HorovodRunner: np={np!r}: expected an int")
        if driver_log_verbosity not in ("log_callback_only", "all"):
            raise InvalidInputError(f"HorovodRunner: driver_log_verbosity="
                                    f"{driver_log_verbosity!r}: expected 'log_callback_only' "
                                    "or 'all'")
        self.num_processor, self.driver_log_verbosity = np, driver_log_verbosity

    def run(self, main: Callable[..., Any], **kwargs: Any) -> Any:
        """``main(**kwargs)`` on every rank; rank 0's return value (errors as ``run``'s)."""
        if self.num_processor < 0:
            from .._run import run as run_here

            return run_here(main, kwargs=kwargs, np=-self.num_processor)[0]
        return run(main, kwargs=kwargs, num_proc=self.num_processor or None)[0]
