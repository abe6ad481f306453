"""Ray Train with ringreduce: Horovod's ``HorovodTrainer``, a CNN on scikit-learn's digits.

    python examples/ray_train.py                      # a local Ray with 2 workers
    python examples/ray_train.py --address auto       # an existing Ray cluster

Ray Train starts the workers and restarts them after a failure
(``FailureConfig(max_failures=1)``); each worker runs ``train_loop``, an ordinary Horovod
loop (``ringreduce.torch``): init, broadcast from rank 0, ``DistributedOptimizer``, its
shard of the training set. Every epoch rank 0 hands Ray Train a checkpoint, and a
restarted group resumes from the last one (``ray.train.get_checkpoint()``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from typing import Optional

import ray
import ray.train
import torch
from _digits import digits_split
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from torch import nn

from ringreduce.ray.train import HorovodConfig, HorovodTrainer


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))


def train_loop(config: dict) -> None:
    """One worker: a Horovod training loop, with Ray Train's checkpoints and reports."""
    import ringreduce.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x_train, x_test, y_train, y_test = (torch.from_numpy(a) for a in config["data"])
    x_train, x_test = x_train.permute(0, 3, 1, 2), x_test.permute(0, 3, 1, 2)
    mine = slice(hvd.rank(), None, hvd.size())  # this rank's shard
    x, y = x_train[mine], y_train[mine]
    model = make_net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    start = resume(model, opt)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for epoch in range(start, config["epochs"]):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(x) - config["batch_size"] + 1, config["batch_size"]):
            batch = order[i:i + config["batch_size"]]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).double().mean()
        acc = float(hvd.allreduce(acc, name="test_acc"))  # equal weights: same everywhere
        report(model, opt, epoch, acc, hvd.rank())


def resume(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load Ray Train's last checkpoint, if this group resumes one; the epoch to start at."""
    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        state = torch.load(os.path.join(d, "state.pt"))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


def report(model: nn.Module, opt: torch.optim.Optimizer, epoch: int, acc: float,
           rank: int) -> None:
    """Every rank reports (Ray Train's rule); rank 0 attaches the checkpoint."""
    metrics = {"epoch": epoch, "test_acc": acc}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as d:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch}, os.path.join(d, "state.pt"))
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train; return the final test accuracy."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--epochs", type=int, default=8, help="epochs (default 8)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD rate for one rank (0.05)")
    p.add_argument("--address", default=None, help="Ray cluster (default: a local one)")
    p.add_argument("--storage", default=os.path.abspath("ray_results"),
                   help="where Ray Train keeps the checkpoints (default ./ray_results)")
    args = p.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
    result = HorovodTrainer(
        train_loop,
        train_loop_config={"lr": args.lr, "epochs": args.epochs, "batch_size": args.batch_size,
                           "data": digits_split(images=True)},  # small: sent with the config
        horovod_config=HorovodConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(name="ringreduce-digits", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=1))).fit()
    acc = result.metrics["test_acc"]
    print(f"epochs {result.metrics['epoch'] + 1}, final test accuracy: {acc:.4f}", flush=True)
    return acc


if __name__ == "__main__":
    main()
