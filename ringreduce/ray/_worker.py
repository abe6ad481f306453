"""The Ray actor behind each rank of a ``RayExecutor`` (``ringreduce/ray/__init__.py`` states
the protocol). Its methods run one at a time, in the actor's process, which stays up between
the executor's calls: ringreduce stays initialized there, as in Horovod's workers."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from .. import _task_world as tw


class Worker:
    """One rank: its launch variables (in ``os.environ``), the user's executable object,
    and whether its last call succeeded (a failure anywhere breaks the world)."""

    def __init__(self) -> None:
        self.executable: Any = None
        self.ok = True

    def describe(self) -> tuple[tw.Worker, list[str]]:
        """This actor as a worker (its node's IP address, a free port) and its GPU ids."""
        import ray

        return this_worker(), [str(g) for g in ray.get_gpu_ids()]

    def join(self, env: Mapping[str, str]) -> None:
        """Leave the previous world, if any, and keep ``env`` (the next world's launch)."""
        join_world(env)
        self.ok = True

    def leave(self) -> None:
        """Leave the world (``ringreduce.shutdown()``), before the actor is killed."""
        leave_world()

    def healthy(self) -> bool:
        """False when this rank's last call failed (answered after any call in flight)."""
        return self.ok

    def build(self, cls: Optional[type], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict:
        """Make the executable object (``executable_cls(*args, **kwargs)``); a record."""
        def make() -> None:
            self.executable = cls(*args, **kwargs) if cls is not None else None

        return self.call(make, (), {}, False)

    def call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
             executable: bool) -> dict:
        """``fn(*args, **kwargs)``, or ``fn(executable, ...)`` if ``executable``; a record
        (``_task_world.call``: an error leaves the world at once)."""
        record = tw.call(fn, (self.executable, *args) if executable else args, kwargs)
        self.ok = self.ok and record["ok"]
        return record

    def elastic(self, env: Mapping[str, str], fn: Callable[..., Any], args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> dict:
        """One elastic worker's life (``ringreduce/ray/elastic.py``): ``fn(*args,
        **kwargs)`` with the driver's variables in ``os.environ``; a record with the rank
        and generation it ended in, and its exit code (0 also for a worker told to leave)."""
        os.environ.update(env)
        return tw.elastic_call(fn, args, kwargs)

    def value(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
              what: str) -> Any:
        """``fn(*args, **kwargs)``'s value, or its error raised again (``run_remote``)."""
        record = self.call(fn, args, kwargs, False)
        if not record["ok"]:
            tw.reraise(record, f"{what}: rank {os.environ.get('RANK')}")
        return record["value"]


# ---------------------------------------------- also Ray Train's workers (train.py)
def this_worker() -> tw.Worker:
    """This Ray process as a worker: its node's IP address, a port free there."""
    import ray

    return tw.describe(ray.util.get_node_ip_address())


def join_world(env: Mapping[str, str]) -> None:
    """Leave the previous world, if any, and keep ``env`` (the next world's launch) in
    ``os.environ`` for good: the user's ``init()`` reads it there."""
    from .. import shutdown

    shutdown()
    os.environ.update(env)


def leave_world() -> None:
    """Leave the world (``ringreduce.shutdown()``)."""
    from .. import shutdown

    shutdown()
