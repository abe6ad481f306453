"""A PyTorch Lightning training step: ringreduce's strategy against Lightning's DDP.

Run under MPI (mpi4py bootstraps the peers and gathers timings)::

    mpirun -np 2 python benchmarks/lightning_step.py
    mpirun -np 2 python benchmarks/lightning_step.py --width 512 --steps 30

One fit per implementation, in the same processes, of the same MLP (``--layers`` Linear
layers of ``--width``, float32, SGD with momentum) on random batches of ``--batch`` rows:

* ``no-comm``: ``Trainer(strategy="auto")`` on each rank alone: the floor;
* ``ringreduce``: ``Trainer(strategy="ringreduce")``;
* ``ddp-gloo``: Lightning's ``DDPStrategy`` on torch.distributed's gloo backend (what a
  Lightning user on CPUs runs today), its processes given by the same launch
  (``LightningEnvironment``; each rank a node of its own).

A step's time is the gap between consecutive ``on_train_batch_end`` calls (forward,
backward, the gradients' average, the optimizer step, Lightning's own work), the median
over ``--steps`` steps after ``--warmup``, the largest over the ranks. Before timing, the
ringreduce and DDP fits must leave the same weights (both average the same gradients).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import warnings

import torch
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def make_model(pl: object, width: int, layers: int) -> object:
    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            mods = []
            for _ in range(layers):
                mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*mods)

        def training_step(self, batch: tuple, idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    return MLP()


def step_times(pl: object, strategy: object, args: argparse.Namespace, **trainer: object
               ) -> tuple[list[float], torch.Tensor]:
    """Per-step seconds of one fit, and the trained weights."""
    stamps: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_end(self, *a: object) -> None:
            stamps.append(time.perf_counter())

    g = torch.Generator().manual_seed(1 + COMM.rank)
    n = args.batch * (args.steps + args.warmup + 1)
    data = torch.utils.data.TensorDataset(torch.randn(n, args.width, generator=g),
                                          torch.randn(n, args.width, generator=g))
    model = make_model(pl, args.width, args.layers)
    pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, use_distributed_sampler=False, callbacks=[Clock()],
               **trainer).fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][args.warmup:]
    return gaps, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ddp_strategy(pl: object) -> object:
    """Lightning's DDP over gloo, each rank a node of its own, the launch's ranks."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    port = COMM.bcast(_free_port() if COMM.rank == 0 else None)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WORLD_SIZE": str(COMM.size), "RANK": str(COMM.rank),
                       "NODE_RANK": str(COMM.rank), "LOCAL_RANK": "0"})
    return pl.strategies.DDPStrategy(cluster_environment=LightningEnvironment(),
                                     process_group_backend="gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // COMM.size))
    import lightning.pytorch as pl

    import ringreduce.lightning  # noqa: F401 - strategy="ringreduce"
    import ringreduce.torch as rr

    rr.init()
    results, weights = {}, {}
    for name, strategy, extra in (("no-comm", "auto", {"devices": 1}),
                                  ("ringreduce", "ringreduce", {"devices": 1}),
                                  ("ddp-gloo", ddp_strategy(pl),
                                   {"devices": 1, "num_nodes": COMM.size})):
        COMM.Barrier()
        gaps, weights[name] = step_times(pl, strategy, args, **extra)
        results[name] = max(COMM.allgather(statistics.median(gaps)))
    diff = float((weights["ringreduce"] - weights["ddp-gloo"]).abs().max())
    if COMM.rank == 0:
        params = sum(w.numel() for w in [weights["no-comm"]])
        print(f"# Lightning {pl.__version__}, torch {torch.__version__}, np={COMM.size}, "
              f"{args.layers} x Linear({args.width}), {params / 1e6:.2f} M float32 "
              f"parameters ({params * 4 / 2**20:.1f} MiB of gradients), batch {args.batch}")
        print(f"# ringreduce vs ddp-gloo weights after {args.steps + args.warmup + 1} steps: "
              f"max |diff| {diff:.2e}")
        print(f"{'implementation':>16} {'ms/step':>9} {'added ms':>9}")
        for name, t in results.items():
            print(f"{name:>16} {t * 1e3:9.2f} {(t - results['no-comm']) * 1e3:9.2f}")
    if diff > 1e-4:
        raise SystemExit(f"ringreduce and DDP disagree: max |diff| {diff}")


if __name__ == "__main__":
    main()
