"""One Ray driver (a private local cluster of 4 CPUs) running the cases of
``ringreduce.ray.train`` (Ray Train with ringreduce) in order, for tests/test_ray.py. Each
case prints one JSON line ``{"case": name, "seconds": ..., "value" or "error"...}``; a case
that raises reports its error and the next one still runs.

The training function writes what each rank saw (one JSON file per rank and attempt) under
``$RR_MARKS``: Ray Train keeps only rank 0's reports with a checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
from ray.train import BackendConfig, FailureConfig, RunConfig, ScalingConfig
from ray_driver import run_cases

from ringreduce.exceptions import InvalidInputError
from ringreduce.ray.train import HorovodConfig, HorovodTrainer, RingreduceConfig, RingreduceTrainer

CASES = []
MARKS = Path(os.environ.get("RR_MARKS", tempfile.mkdtemp()))
STORAGE = Path(os.environ.get("RR_RAY_TMP", tempfile.mkdtemp())) / "results"
STEPS, LR, ROWS = 8, 0.1, 16
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def case(body):
    CASES.append(body)
    return body


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 3))
    return x, x @ np.array([[1.0], [-2.0], [0.5]]) + 0.1 * rng.normal(size=(ROWS, 1))


def reference() -> list[float]:
    """Full-batch gradient descent on all rows: what averaged equal shards must give."""
    x, y = data()
    w = np.zeros((3, 1))
    for _ in range(STEPS):
        w -= LR * 2 * x.T @ (x @ w - y) / ROWS
    return w.ravel().tolist()


# ------------------------------------------------------------ what the ranks run
def regression(config: dict) -> None:
    """Linear regression with Horovod's recipe; rank 0 reports a checkpoint every step.
    ``die_at``: rank 1 exits there, once (a marker file), to make Ray Train restart."""
    import ray.train
    import torch

    import ringreduce.torch as hvd

    hvd.init()
    marks, rank = Path(config["marks"]), hvd.rank()
    x, y = (torch.from_numpy(a) for a in data())
    share = ROWS // hvd.size()
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    model = torch.nn.Linear(3, 1, bias=False).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    start = _resume(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    seen: dict = {"rank": rank, "start": start, "pid": os.getpid(),
                  "world_rank": ray.train.get_context().get_world_rank(),
                  "local": [hvd.local_rank(), hvd.local_size()], "size": hvd.size(),
                  "env": {k: os.environ.get(k) for k in ("RINGREDUCE_CONNECT_TIMEOUT_SECONDS",
                                                         "HOROVOD_FUSION_THRESHOLD", "RR_MARK")}}
    if config.get("shards"):
        seen["shards"] = shard_sum()
    try:
        for step in range(start, STEPS):
            if step == config.get("die_at") and rank == 1 and not (marks / "died").exists():
                (marks / "died").write_text(str(time.time()))
                os._exit(1)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            _report(model, step, rank)
    except Exception as e:
        seen.update(error=type(e).__name__, message=str(e), at=time.time())
        raise
    finally:
        seen["weights"] = model.weight.detach().ravel().tolist()
        (marks / f"{config['case']}.{rank}.{start}.json").write_text(json.dumps(seen))


def failing(config: dict) -> None:
    """Rank 1 raises in its second step. ``freeze``: rank 0 stops itself (SIGSTOP) first,
    so it can answer nothing when Ray Train stops the group."""
    import signal

    import ringreduce as rr

    rr.init()
    marks, rank = Path(config["marks"]), rr.rank()
    seen: dict = {"rank": rank}
    try:
        for step in range(3):
            if step == 1 and rank == 0 and config.get("freeze"):
                os.kill(os.getpid(), signal.SIGSTOP)
            if step == 1 and rank == 1:
                time.sleep(0.3)
                raise ValueError("rank 1 gives up at step 1")
            rr.allreduce(np.ones(4), name=f"step.{step}")
    except Exception as e:
        seen.update(error=type(e).__name__, message=str(e))
        raise
    finally:
        (marks / f"{config['case']}.{rank}.json").write_text(json.dumps(seen))


def _resume(model) -> int:
    """Load the last checkpoint Ray Train hands this attempt; the step to start at."""
    import ray.train
    import torch

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        with torch.no_grad():
            model.weight.zero_()
        return 0
    with ckpt.as_directory() as d:
        state = torch.load(Path(d) / "state.pt")
    model.load_state_dict(state["model"])
    return state["step"] + 1


def _report(model, step: int, rank: int) -> None:
    """Every rank reports (Ray Train's rule); rank 0 attaches the checkpoint."""
    import ray.train
    import torch
    from ray.train import Checkpoint

    if rank != 0:
        ray.train.report({"step": step})
        return
    with tempfile.TemporaryDirectory() as d:
        torch.save({"model": model.state_dict(), "step": step}, Path(d) / "state.pt")
        ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))


def shard_sum() -> dict:
    """The ids of this rank's Ray Data shard summed, and that summed across ranks by
    ringreduce: every row is read by exactly one rank when the total is sum(range(64))."""
    import ray.train

    import ringreduce as rr

    mine = 0.0
    for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=8):
        mine += float(batch["id"].sum())
    return {"mine": mine, "total": float(rr.allreduce(np.array([mine]), op=rr.Sum)[0])}


# ------------------------------------------------------------------------ cases
def marks(prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(MARKS.glob(prefix + ".*.json"))]


def stored(result) -> dict:
    import torch

    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt")
    return {"step": state["step"], "weights": state["model"]["weight"].ravel().tolist()}


@case
def trains():
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "1048576"  # captured by the config, forwarded
    config = HorovodConfig(timeout_s=20, env={"RR_MARK": 7})
    result = HorovodTrainer(
        regression, train_loop_config={"marks": str(MARKS), "case": "trains", "shards": True},
        horovod_config=config, scaling_config=ScalingConfig(num_workers=2),
        datasets={"train": ray.data.range(64)},
        run_config=RunConfig(storage_path=str(STORAGE), name="trains")).fit()
    return {"ranks": marks("trains"), "stored": stored(result), "reference": reference(),
            "error": None if result.error is None else repr(result.error)}


@case
def recovers():
    began = time.time()
    result = RingreduceTrainer(
        regression, train_loop_config={"marks": str(MARKS), "case": "recovers", "die_at": 4},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(STORAGE), name="recovers",
                             failure_config=FailureConfig(max_failures=1))).fit()
    died = float((MARKS / "died").read_text()) if (MARKS / "died").exists() else None
    return {"ranks": marks("recovers"), "stored": stored(result), "reference": reference(),
            "died_after": None if died is None else died - began,
            "error": None if result.error is None else repr(result.error)}


@case
def raises():
    """No restarts: rank 0 learns of rank 1's error from ringreduce, and fit raises it."""
    try:
        RingreduceTrainer(failing, train_loop_config={"marks": str(MARKS), "case": "raises"},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=str(STORAGE), name="raises")).fit()
    except Exception as e:
        return {"ranks": marks("raises"), "fit": type(e).__name__,
                "names_value_error": "rank 1 gives up at step 1" in str(e)}
    return {"ranks": marks("raises"), "fit": None}


@case
def frozen():
    """Rank 0 frozen, rank 1 raising: Ray Train's stop of the group must not wait on
    rank 0 for good (on_shutdown's timeout); fit ends with the error."""
    began = time.monotonic()
    try:
        RingreduceTrainer(failing, train_loop_config={"marks": str(MARKS), "case": "frozen",
                                                      "freeze": True},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=str(STORAGE), name="frozen")).fit()
    except Exception as e:
        return {"fit": type(e).__name__, "seconds": time.monotonic() - began}
    return {"fit": None}


@case
def example():
    """examples/ray_train.py on this cluster, 4 epochs; its module is found by the workers
    through the PYTHONPATH main() gave the cluster."""
    import importlib

    sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module("ray_train")
    return {"accuracy": module.main(["--epochs", "4", "--storage", str(STORAGE)])}


@case
def refusals():
    def refused(make) -> str:
        try:
            make()
        except InvalidInputError as e:
            return str(e)
        return "accepted"

    return {"two_nics": refused(lambda: RingreduceConfig(nics={"eth0", "eth1"})),
            "both": refused(lambda: RingreduceTrainer(regression, ringreduce_config=HorovodConfig(),
                                                      horovod_config=HorovodConfig())),
            "foreign": refused(lambda: RingreduceTrainer(regression,
                                                         horovod_config=BackendConfig())),
            "one_nic": RingreduceConfig(nics={"lo"}).worker_env.get("RINGREDUCE_IFACE")}


def main() -> int:
    MARKS.mkdir(parents=True, exist_ok=True)
    # The controller takes reports (and sees failures) at each health check, 2 s apart by
    # default: 0.5 s keeps a report per step cheap, and still gives rank 0 (which finds its
    # peer gone in ~0.1 s) time to record its error before Ray Train stops the group.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES),
                                                             os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20,
             _temp_dir=os.environ.get("RR_RAY_TMP"), configure_logging=False)
    run_cases(CASES)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
