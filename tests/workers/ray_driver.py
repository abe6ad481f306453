"""One Ray driver (a private local cluster of 4 CPUs) running every case of
tests/test_ray.py in order: Ray takes seconds to start, so the cases share it, and most
share one 2-rank executor, whose state each case leaves for the next. Each case prints one
JSON line ``{"case": name, "seconds": ..., "value" or "error"...}``; a case that raises
reports its error and the next one still runs.

Ray's files go under ``$RR_RAY_TMP`` (short: Ray's sockets live there), so the test can
tell that none of this cluster's processes outlived it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import ray

from ringreduce.exceptions import InvalidInputError
from ringreduce.ray import RayExecutor

CASES = []


def case(body):
    CASES.append(body)
    return body


# ------------------------------------------------------------ what the ranks run
def join_and_reduce(scale):
    import ringreduce as rr

    was_in = rr.is_initialized()
    rr.init()
    avg = rr.allreduce(np.ones(4) * rr.rank() * scale)
    return {"rank": rr.rank(), "size": rr.size(), "local": [rr.local_rank(), rr.local_size()],
            "was_in": was_in, "avg": avg.tolist(), "pid": os.getpid(),
            "port": os.environ["MASTER_PORT"]}


def launch_vars():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "RINGREDUCE_CONNECT_TIMEOUT_SECONDS", "RR_RAY_MARK", "HOROVOD_FUSION_THRESHOLD")
    return {k: os.environ.get(k) for k in keys}


def one_sgd_step():
    import torch

    import ringreduce.torch as hvd

    hvd.init()
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1),
                                   named_parameters=layer.named_parameters())
    opt.zero_grad()
    # rank r's gradient is [r + 1, 0]: averaged [1.5, 0], so the weight becomes [0.85, 1]
    layer(torch.tensor([[hvd.rank() + 1.0, 0.0]])).sum().backward()
    opt.step()
    return layer.weight.detach().flatten().tolist()


def raise_on_rank_1():
    import ringreduce as rr

    rr.init()
    if rr.rank() == 1:
        time.sleep(0.5)  # rank 0 waits in the allreduce by then
        raise ValueError("rank 1 found a bad shard")
    return rr.allreduce(np.arange(3.0)).tolist()


def exit_on_rank_1():
    import ringreduce as rr

    rr.init()
    if rr.rank() == 1:
        time.sleep(0.5)
        os._exit(3)
    return rr.allreduce(np.arange(3.0)).tolist()


class Counter:
    """The executable: one per actor, kept between calls."""

    def __init__(self, start, step=1):
        self.count, self.step = start, step

    def bump(self):
        self.count += self.step
        return self.count


# ------------------------------------------------------------------------ cases
def failure(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e),
            "cause": str(e.__cause__) if e.__cause__ is not None else None,
            "is_value_error": isinstance(e, ValueError)}


class State:
    executor: RayExecutor = None
    pids: list = []


@case
def start():
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "1048576"  # the driver forwards it
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    ex.start(executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5},
             extra_env_vars={"RR_RAY_MARK": 7})
    State.executor = ex
    return {}


@case
def run_twice():
    first = State.executor.run(join_and_reduce, args=[2.0])
    second = State.executor.run(join_and_reduce, kwargs={"scale": 4.0})
    State.pids = [r["pid"] for r in second]
    return {"first": first, "second": second}


@case
def environment():
    return State.executor.run(launch_vars)


@case
def torch_step():
    return State.executor.run(one_sgd_step)


@case
def executable():
    everywhere = State.executor.execute(lambda counter: counter.bump())
    single = State.executor.execute_single(lambda counter: counter.bump())
    refs = State.executor.run_remote(join_and_reduce, args=[1.0])
    remote = [r["rank"] for r in ray.get(refs)]
    return {"execute": everywhere, "single": single, "remote": remote,
            "refs_are_refs": all(isinstance(r, ray.ObjectRef) for r in refs)}


@case
def failing():
    return State.executor.run(raise_on_rank_1)


@case
def after_failure():
    return State.executor.run(join_and_reduce, args=[1.0])


@case
def dying():
    return State.executor.run(exit_on_rank_1)


@case
def after_death():
    got = State.executor.run(join_and_reduce, args=[1.0])
    counters = State.executor.execute(lambda counter: counter.count)
    return {"run": got, "counters": counters, "old_pids": State.pids}


@case
def remote_failure():
    errors = []
    for ref in State.executor.run_remote(raise_on_rank_1):
        try:
            errors.append(ray.get(ref))
        except Exception as e:
            errors.append(failure(e))
    after = State.executor.run(join_and_reduce, args=[1.0])
    return {"errors": errors, "after": [r["rank"] for r in after]}


@case
def shutdown():
    pids = [r["pid"] for r in State.executor.run(join_and_reduce, args=[1.0])]
    State.executor.shutdown()
    State.executor.shutdown()  # harmless twice
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        State.executor.run(launch_vars)
        after = None
    except InvalidInputError as e:
        after = str(e)
    return {"alive": [p for p in pids if _alive(p)], "run_after": after}


@case
def hosts():
    ex = RayExecutor(RayExecutor.create_settings(), num_hosts=1, num_workers_per_host=2)
    ex.start()
    try:
        ex.start()
    except InvalidInputError as e:
        again = str(e)
    try:
        return {"run": ex.run(join_and_reduce, args=[1.0]), "start_again": again}
    finally:
        ex.shutdown()


class Broken:
    def __init__(self):
        import ringreduce as rr

        if os.environ["RANK"] == "1":
            raise KeyError("no dataset on this node")
        rr.init()  # rank 0 waits for rank 1 in the rendezvous: it must not hang


@case
def bad_executable():
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    try:
        ex.start(executable_cls=Broken)
    except Exception as e:
        return {**failure(e), "run_after": _refused(lambda: ex.run(launch_vars))}
    return {"started": True}


def _refused(call) -> str:
    try:
        call()
    except InvalidInputError as e:
        return str(e)
    return "accepted"


@case
def no_room():
    settings = RayExecutor.create_settings(placement_group_timeout_s=1)
    ex = RayExecutor(settings, num_workers=8)
    try:
        ex.start()
    except Exception as e:
        groups = ray.util.placement_group_table().values()
        return {**failure(e), "pending_groups": [g["state"] for g in groups
                                                 if g["state"] not in ("REMOVED",)]}
    return {"started": True}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def run_cases(cases: list) -> None:
    """Each case in order, one JSON line each; a case that raises reports its error and
    the next one still runs (also for the other Ray drivers)."""
    for body in cases:
        began = time.monotonic()
        try:
            out = {"value": body()}
        except Exception as e:
            out = {**failure(e), "traceback": traceback.format_exc()}
        line = {"case": body.__name__, "seconds": round(time.monotonic() - began, 2), **out}
        print(json.dumps(line, default=str), flush=True)


def main() -> int:
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20,
             _temp_dir=os.environ.get("RR_RAY_TMP"), configure_logging=False)
    run_cases(CASES)
    if State.executor is not None:
        State.executor.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
