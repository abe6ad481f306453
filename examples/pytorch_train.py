"""Data-parallel training of a small CNN on scikit-learn's digits with ringreduce.torch.

Run with any number of processes::

    mpirun -np 2 python examples/pytorch_train.py
    mpirun -np 2 python examples/pytorch_train.py --resume      # continue from checkpoints/

On a machine with NVIDIA GPUs each rank trains on GPU ``local_rank()`` (``--device auto``,
the default, picks CUDA when torch sees a GPU; one process per GPU) and the gradients are
averaged by NCCL on the GPU; ``--device cpu`` keeps everything on the host.

Horovod's recipe: every rank keeps a fixed per-rank batch (so the global batch, and
the learning rate with it, scale with the number of ranks), the training set is
sharded by rank, the initial weights and optimizer state are broadcast from rank 0,
DistributedOptimizer averages gradients during backward, metrics are averaged across
ranks, and rank 0 alone writes an atomic checkpoint after every epoch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import ringreduce.torch as rr

#: The train/test split never changes, whatever --seed is, so accuracies are comparable.
SPLIT_SEED = 0
CKPT_NAME = "ckpt.pt"
#: The learning rate is multiplied by this after every epoch.
LR_DECAY = 0.8


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags (``argv`` without the program name; None: sys.argv)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="total epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="SGD learning rate for one rank; multiplied by size() (default 0.05)")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                   help="gradient compression on the wire (default none)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument("--checkpoint-dir", default="checkpoints",
                   help=f"where rank 0 writes {CKPT_NAME} after every epoch")
    p.add_argument("--resume", action="store_true", help=f"resume from <dir>/{CKPT_NAME}")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to train: auto (default) is cuda when torch sees a GPU")
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size <= 0 or args.lr <= 0:
        p.error("--epochs must be >= 0, --batch-size and --lr > 0")
    return args


class Net(nn.Module):
    """Two 3x3 convolutions, max pooling and two dense layers for 8x8 digits (~43 k params)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images shaped (n, 1, 8, 8)."""
        return self.head(self.features(x))


def pick_device(choice: str) -> torch.device:
    """This rank's device: GPU ``local_rank()`` (Horovod's recipe) or the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(rr.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def load_data(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The digits as float images in [0, 1] and int64 labels on ``device``: x_train,
    y_train, x_test, y_test."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(x, digits.target.astype(np.int64), test_size=0.2,
                                          random_state=SPLIT_SEED, stratify=digits.target)
    return tuple(torch.from_numpy(a).to(device) for a in (xtr, ytr, xte, yte))


def shard(n: int, batch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """This rank's batches of sample indices for one epoch (like DistributedSampler).

    The permutation depends only on (seed, epoch): the same on every rank and after
    a resume. Rank r takes perm[r::size]; every rank gets the same number of batches.
    """
    perm = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n))  # host indices
    mine = perm[rr.rank()::rr.size()][: n // rr.size()]
    return [mine[i:i + batch] for i in range(0, len(mine) - batch + 1, batch)]


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy over the whole test set; each rank scores its rank::size share. Collective."""
    model.eval()
    xs, ys = x[rr.rank()::rr.size()], y[rr.rank()::rr.size()]
    correct = int((model(xs).argmax(1) == ys).sum()) if len(ys) else 0
    model.train()
    totals = rr.allreduce(torch.tensor([correct, len(ys)], device=x.device), op=rr.Sum,
                          name="eval")
    return float(totals[0]) / max(float(totals[1]), 1.0)


def setup(args: argparse.Namespace,
          device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Model and DistributedOptimizer, identical on every rank; returns the start epoch."""
    torch.manual_seed(args.seed + rr.rank())  # different on purpose: the broadcast fixes it
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * rr.size(), momentum=0.9)
    opt = rr.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=getattr(rr.Compression, args.compression))
    path = os.path.join(args.checkpoint_dir, CKPT_NAME)
    if args.resume:  # rank 0 reads, every rank gets the same values (or the same error)
        return model, opt, int(rr.load_checkpoint(path, model=model, optimizer=opt)["epoch"])
    rr.broadcast_parameters(model.state_dict(), root_rank=0)
    rr.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt, 0


def train(args: argparse.Namespace) -> float:
    """Train and evaluate (ringreduce initialised); returns the final test accuracy."""
    device = pick_device(args.device)
    if rr.rank() == 0:
        print(f"{rr.size()} rank(s); rank 0 trains on {device}", flush=True)
    xtr, ytr, xte, yte = load_data(device)
    model, opt, start = setup(args, device)
    loss_fn = nn.CrossEntropyLoss()
    steps = len(shard(len(xtr), args.batch_size, args.seed, 0))
    bar = tqdm(total=args.epochs * steps, initial=min(start, args.epochs) * steps,
               disable=rr.rank() != 0, desc=f"train x{rr.size()}", unit="step")
    for epoch in range(start, args.epochs):
        for group in opt.param_groups:  # decay by epoch number alone: resumes stay exact
            group["lr"] = args.lr * rr.size() * LR_DECAY ** epoch
        total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches
        for idx in shard(len(xtr), args.batch_size, args.seed, epoch):
            opt.zero_grad()
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach().double(), total.new_ones(())])
            bar.update(1)
        mean = rr.allreduce(total, op=rr.Sum, name="epoch_loss")
        acc = evaluate(model, xte, yte)
        bar.set_postfix(epoch=epoch + 1, loss=f"{float(mean[0] / mean[1]):.4f}",
                        test_acc=f"{acc:.3f}")
        rr.save_checkpoint(os.path.join(args.checkpoint_dir, CKPT_NAME), model=model,
                           optimizer=opt, epoch=epoch + 1)
    bar.close()
    return evaluate(model, xte, yte)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Entry point: initialise, train, print the final accuracy on rank 0."""
    args = parse_args(argv)
    rr.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // rr.local_size()))
    try:
        acc = train(args)
        if rr.rank() == 0:
            print(f"final test accuracy: {acc:.3f}", flush=True)
        return acc
    finally:
        rr.shutdown()


if __name__ == "__main__":
    main()
