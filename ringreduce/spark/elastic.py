"""Elastic training on Spark: Horovod's ``horovod.spark.run_elastic``.

It is ``ringrun``'s elastic mode (``ringreduce/elastic/driver.py`` states the generation
protocol) with Spark tasks as its hosts. The protocol of one call:

  1. The driver process runs the elastic driver, a task registry (``TaskRegistry``: a port
     of its own, connections authenticated with a secret of this call, as the driver's)
     and, in a thread, one Spark job of ``max_num_proc`` tasks. The stage is not a barrier
     stage: a task that fails is retried by Spark alone, which is what makes the job
     elastic (Horovod relies on the same).
  2. Each task registers (``("task", partition, attempt)``) and waits. To the elastic
     driver each registered task is a host of one slot, named ``task<partition>.<attempt>
     @<executor address>``; ``SparkTasks`` lists those that wait or run a worker.
  3. The driver starts a worker on a task by sending it ``("run", env)``: the task sets
     ``env`` (the driver's address, the worker's id, the job's secret), calls ``fn`` in its
     Python worker with its output relayed to the driver, sends ``("record", record)``
     and returns. A task whose connection ends without a record is a worker that died: a
     crashed Python worker, which Spark retries as a new attempt, a new host (so the
     job grows back at the members' next commit). ``("kill",)`` makes a task's watcher
     end its Python worker at once (a worker the driver gave up on).
  4. Once the elastic job is over, every waiting task, and every task that registers
     later, is sent ``("exit",)`` and returns without training; the call waits for the
     Spark job to end (cancelling it after a grace period).
Invariants: a task runs ``fn`` at most once, and host names are never reused (a retry
is a new attempt), so a blacklisted task attempt never gets a worker again.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from typing import Any, Callable, Optional

from .. import _task_world as tw
from ..elastic.discovery import Discovery
from ..elastic.driver import ElasticDriver, ElasticSettings, authenticated, drive
from ..exceptions import RingReduceError
from ..launcher import HostSlots, _say
from .output import OutputRelay, relayed

_JOB_GRACE = 30.0  # seconds the Spark job may take to end after the elastic job did


@dataclass
class TaskSlot:
    """One registered task: its connection and what became of the worker it ran."""

    name: str
    conn: Connection
    state: str = "waiting"  # waiting, running, ended
    code: Optional[int] = None
    record: Optional[dict] = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    wid: str = ""

    # ``processes.WorkerProcess``: the driver's handle on the worker running here
    @property
    def where(self) -> str:
        return f"Spark {self.name.split('@')[0]}"

    def poll(self) -> Optional[int]:
        return self.code

    def send(self, message: tuple) -> bool:
        with self.lock:
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):
                return False

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        if self.state == "running":  # not ended: see TaskRegistry._watch
            self.send(("kill",))

    def close(self, timeout: float) -> None:
        pass  # the output went through the relay


class TaskRegistry(Discovery):
    """The tasks' connections (step 2 of the protocol) and, as ``Discovery``, the hosts
    they make; also the elastic driver's ``Spawn`` (step 3)."""

    handshake_seconds = 30.0

    def __init__(self, secret: str) -> None:
        self.key = secret.encode()
        self.server = socket.create_server(("", 0))
        self.port = self.server.getsockname()[1]
        self.slots: dict[str, TaskSlot] = {}
        self.cond = threading.Condition()
        self.over = False  # the elastic job ended: tasks are sent ("exit",)
        threading.Thread(target=self._accept, daemon=True, name="rr-spark-tasks").start()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(sock, peer[0]), daemon=True).start()

    def _serve(self, sock: socket.socket, address: str) -> None:
        conn = authenticated(sock, self.key, self.handshake_seconds)
        if conn is None:
            return
        with conn:
            try:
                kind, partition, attempt = conn.recv()
            except (OSError, EOFError, ValueError, TypeError):
                return
            slot = TaskSlot(f"task{partition}.{attempt}@{address}", conn)
            with self.cond:
                self.slots[slot.name] = slot
                if self.over:
                    slot.send(("exit",))
                self.cond.notify_all()
            self._watch(slot)

    def _watch(self, slot: TaskSlot) -> None:
        """Wait for the task's record; a connection that ends first is a dead worker."""
        record = None
        try:
            message = slot.conn.recv()
            record = message[1] if message[0] == "record" else None
        except (OSError, EOFError, IndexError, TypeError):
            pass
        with self.cond:
            ran, slot.state, slot.record = slot.state == "running", "ended", record
            # the state before the code: the driver polls the code, then kills a worker
            # that has not ended; an ended task must never be sent ("kill",)
            slot.code = -9 if record is None else record.get("code", 0 if record["ok"] else 1)
        if record is not None:
            slot.send(("bye",))
        elif ran:
            _say(f"worker {slot.wid}'s Spark task {slot.name} ended without a result (its "
                 "Python worker died)")

    # ------------------------------------------------------------------ Discovery
    def poll(self) -> Optional[list[HostSlots]]:
        with self.cond:
            return [HostSlots(s.name, 1) for s in self.slots.values() if s.state != "ended"]

    # ---------------------------------------------------------------------- Spawn
    def __call__(self, wid: str, host: HostSlots, slot: int, mine: dict) -> TaskSlot:
        with self.cond:
            task = self.slots.get(host.host)
            if task is None or task.state != "waiting":
                raise OSError(f"Spark task {host.host} is not waiting for a worker")
            task.state, task.wid = "running", wid
        if not task.send(("run", mine)):
            raise OSError(f"Spark task {host.host} went away")
        return task

    def wait_for(self, count: int, timeout: float, stop: Callable[[], bool]) -> None:
        """Wait until ``count`` tasks are waiting, ``timeout`` seconds passed or ``stop()``
        (the Spark job ended), so that the first generation has the workers asked for
        (Horovod waits for them too): tasks that register later are hosts added, which
        the job grows onto at a commit."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while sum(s.state == "waiting" for s in self.slots.values()) < count:
                if stop() or time.monotonic() > deadline:
                    return
                self.cond.wait(0.2)

    def end(self) -> None:
        """Step 4: every waiting task (and every later one) returns without training."""
        with self.cond:
            self.over = True
            for s in self.slots.values():
                if s.state == "waiting":
                    s.send(("exit",))

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        self.server.close()

    def records(self) -> list[dict]:
        with self.cond:
            return [s.record for s in self.slots.values() if s.record is not None]


class _ElasticTask:
    """What each Spark task runs (pickled by Spark with ``fn`` inside): steps 2 and 3."""

    def __init__(self, call: tuple, env: Mapping[str, str], secret: str,
                 registry: tuple[str, int], output: tuple[str, int]) -> None:
        self.call, self.env, self.secret = call, dict(env), secret
        self.registry, self.output = registry, output

    def __call__(self, partition: int, _rows: Any) -> Any:
        from pyspark import TaskContext

        attempt = TaskContext.get().attemptNumber()
        with Client(self.registry, authkey=self.secret.encode()) as conn:
            conn.send(("task", partition, attempt))
            message = conn.recv()
            if message[0] == "run":  # else ("exit",): the job is over, nothing to train
                watcher = threading.Thread(target=_watch_driver, args=(conn,), daemon=True)
                record = self._train(watcher, {**self.env, **message[1]})
                conn.send(("record", record))
                watcher.join()  # it reads the driver's ("bye",)
        return iter([])

    def _train(self, watcher: threading.Thread, env: dict) -> dict:
        """``fn`` with ``env`` set, its output relayed, ``watcher`` running meanwhile; its
        record, with the rank and generation it ended in."""
        from ..elastic._client import WORKER_VAR

        saved = tw.set_environ(env)
        watcher.start()
        try:
            with relayed(self.output, self.secret, env[WORKER_VAR]):
                return tw.elastic_call(*self.call)
        finally:
            tw.restore_environ(saved)


def _watch_driver(conn: Connection) -> None:
    """A training task's second thread: ("kill",) from the driver, or the driver gone,
    ends this Python worker at once (Spark retries the task, which registers anew)."""
    try:
        while conn.poll(None):
            message = conn.recv()
            if message[0] == "bye":
                return
            if message[0] == "kill":
                break
    except (OSError, EOFError):
        pass
    os._exit(1)


def run_job(what: str, sc: Any, fn: Callable[..., Any], args: Sequence[Any],
            kwargs: Mapping[str, Any], settings: ElasticSettings, tasks: int,
            env: Mapping[str, str], relay_to: tuple) -> list:
    """One elastic job on Spark from start to end: the last generation's values in rank
    order (see the module docstring)."""
    secret = tw.new_secret()
    driver_host = sc.getConf().get("spark.driver.host")
    relay = OutputRelay(driver_host, secret, *relay_to)
    registry = TaskRegistry(secret)
    task = _ElasticTask((fn, tuple(args), dict(kwargs)), env, secret,
                        (driver_host, registry.port), relay.address)
    job = _SparkJob(sc, tasks, task)
    try:
        registry.wait_for(settings.np, settings.elastic_timeout,
                          lambda: not job.thread.is_alive())
        driver = ElasticDriver(registry, registry, settings, driver_host, grace=5.0)
        code = drive(driver, None)
    finally:
        registry.end()
        job.finish(_JOB_GRACE)
        registry.close()
        relay.close()
    if job.error is not None and code != 0:
        raise RingReduceError(f"{what}: the Spark job failed: {job.error}") from job.failure
    return tw.elastic_values(what, registry.records(), code, driver.failure)


class _SparkJob:
    """The Spark job of the tasks, run in a thread (its ``collect`` returns when every
    task has); ``finish`` waits for it, cancelling it after a grace period."""

    def __init__(self, sc: Any, tasks: int, task: _ElasticTask) -> None:
        self.sc, self.tasks = sc, tasks
        self.group = f"ringreduce-elastic-{tw.new_secret()[:12]}"
        self.failure: Optional[BaseException] = None
        self.error: Optional[str] = None
        rdd = sc.parallelize(range(tasks), tasks).mapPartitionsWithIndex(task)
        self.thread = threading.Thread(target=self._collect, args=(rdd,), daemon=True)
        self.thread.start()

    def _collect(self, rdd: Any) -> None:
        self.sc.setJobGroup(self.group, "ringreduce elastic job", interruptOnCancel=True)
        try:
            rdd.collect()
        except Exception as e:
            from . import _stage_failure

            self.failure, self.error = e, _stage_failure(e, self.tasks)

    def finish(self, grace: float) -> None:
        self.thread.join(grace)
        if self.thread.is_alive():
            self.sc.cancelJobGroup(self.group)
            self.thread.join(grace)
