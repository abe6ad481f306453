"""One Ray driver running the elastic cases of tests/test_ray_elastic.py in order, on a
private Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``: a
head and worker nodes, each a raylet of its own, so Ray sees them come and go as it sees
machines). Each case prints one JSON line ``{"case": name, "seconds": ..., "value" or
"error"...}``; a case that raises reports its error and the next one still runs.

Every training function records, per epoch, the world size it ran in; the driver changes
the cluster from a thread once the ranks report (through a file in ``$RR_MARKS``) that
they reached a given point, so each change lands in the middle of training.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray_driver import run_cases

from ringreduce.ray import ElasticRayExecutor, RayExecutor

CASES = []
MARKS = Path(os.environ.get("RR_MARKS", "/tmp/rr-marks"))


def case(body):
    CASES.append(body)
    return body


# ------------------------------------------------------------ what the ranks run
def train(until, die_at=None):
    """Train epochs of one allreduce each until ``until(epoch, size, sizes)``; rank 0
    writes ``MARKS/<epoch>-<size>`` after each commit; with ``die_at=(epoch, size)``,
    the last rank of a world of that size exits at that epoch (a crash)."""
    import numpy as np

    import ringreduce as rr

    rr.init()
    state = rr.elastic.ObjectState(epoch=0, total=0.0, sizes=[])

    @rr.elastic.run
    def loop(state):
        while not until(state.epoch, rr.size(), state.sizes):
            if die_at == (state.epoch, rr.size()) and rr.rank() == rr.size() - 1:
                os._exit(3)
            state.total += float(rr.allreduce(np.ones(2), op=rr.Sum)[0])
            state.sizes = state.sizes + [rr.size()]
            state.epoch += 1
            time.sleep(0.05)
            state.commit()
            if rr.rank() == 0:
                (MARKS / f"{state.epoch}-{rr.size()}").touch()
        return {"rank": rr.rank(), "size": rr.size(), "local_size": rr.local_size(),
                "epoch": state.epoch, "total": state.total, "sizes": state.sizes}

    return loop(state)


def seen(size, then):
    """Stop ``then`` epochs after the world first had ``size`` ranks (at most 400)."""
    def until(epoch, now, sizes):
        return epoch >= 400 or (size in sizes and len(sizes) - sizes.index(size) >= then)
    return until


def epochs(n):
    return lambda epoch, size, sizes: epoch >= n


def fail_everywhere():
    import ringreduce as rr

    rr.init()
    raise ValueError(f"bad batch on rank {rr.rank()}")


# ------------------------------------------------------------------------ cases
class Cluster_:
    cluster: Cluster = None
    extra = None  # the worker node that comes and goes


def run_changing(run, size: int, epoch: int, change):
    """``run()`` in a thread; ``change()`` here (Ray changes its cluster from the main
    thread only) once rank 0 has committed ``epoch`` epochs in a world of ``size``."""
    result = {}

    def body():
        try:
            result["value"] = run()
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while t.is_alive() and time.monotonic() < deadline:
        if any(int(e) >= epoch and int(s) == size for e, s in
               (p.name.split("-") for p in MARKS.iterdir())):
            change()
            break
        time.sleep(0.05)
    t.join(180)
    if "error" in result:
        raise result["error"]
    return result["value"]


def elastic_executor(min_np, max_np, **kw):
    settings = ElasticRayExecutor.create_settings(min_num_proc=min_np, max_num_proc=max_np,
                                                  elastic_timeout=60, timeout_s=20)
    ex = ElasticRayExecutor(settings, cpus_per_slot=1, env_vars={"RR_MARKS": str(MARKS)}, **kw)
    ex.start()
    return ex


def fresh_marks():
    MARKS.mkdir(exist_ok=True)
    for p in MARKS.iterdir():
        p.unlink()


@case
def node_joins():
    """The head alone (2 slots) trains; a node of 2 slots joins: the job grows to 4."""
    fresh_marks()
    ex = elastic_executor(2, 4)

    def add():
        Cluster_.extra = Cluster_.cluster.add_node(num_cpus=2)

    return run_changing(lambda: ex.run(lambda: train(seen(4, 5))), 2, 3, add)


@case
def min_workers_executor():
    """Horovod's RayExecutor(min_workers=...): every slot of the 2 nodes, args passed."""
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2, max_workers=8,
                     elastic_timeout=60)
    ex.start(extra_env_vars={"RR_MARKS": str(MARKS)})
    fresh_marks()
    try:
        return ex.run(train, args=[epochs(3)])
    finally:
        ex.shutdown()


@case
def worker_dies():
    """A rank crashes at epoch 3 of the 4-rank world: its node is blacklisted, the other
    node's 2 ranks roll back to the last commit and finish."""
    fresh_marks()
    return elastic_executor(2, 4).run(lambda: train(epochs(10), die_at=(3, 4)))


@case
def node_leaves():
    """The worker node is removed during training: its 2 actors die with it, the head's 2
    ranks go on."""
    fresh_marks()
    ex = elastic_executor(2, 4)
    return run_changing(lambda: ex.run(lambda: train(seen(2, 5))), 4, 3,
                        lambda: Cluster_.cluster.remove_node(Cluster_.extra))


@case
def fails_everywhere():
    """Every rank raises: every node blacklisted; run raises the rank's ValueError."""
    fresh_marks()
    ex = elastic_executor(1, 2)
    try:
        ex.run(fail_everywhere)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e),
                "cause": str(e.__cause__) if e.__cause__ is not None else None}
    return {"raised": False}


class OneNode:
    """Horovod's discovery interface: the head's IP address, 2 slots."""

    def find_available_hosts_and_slots(self):
        return {ray.util.get_node_ip_address(): 2}


@case
def own_discovery():
    """override_discovery=False: the hosts come from settings.discovery, named by IP."""
    fresh_marks()
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2,
                                                  elastic_timeout=60, discovery=OneNode())
    ex = ElasticRayExecutor(settings, override_discovery=False,
                            env_vars={"RR_MARKS": str(MARKS)})
    ex.start()
    return ex.run(lambda: train(epochs(3)))


def main() -> int:
    tmp = os.environ.get("RR_RAY_TMP")
    if tmp:
        # Cluster writes its address to $RAY_TMPDIR/ray/ray_current_cluster (default /tmp/ray,
        # which a fresh machine lacks, and where a later ray.init() would find a dead one)
        os.environ["RAY_TMPDIR"] = tmp
        os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    Cluster_.cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "object_store_memory": 80 * 2**20,
        **({"temp_dir": tmp} if tmp else {})})
    ray.init(address=Cluster_.cluster.address, configure_logging=False)
    run_cases(CASES)
    ray.shutdown()
    Cluster_.cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
