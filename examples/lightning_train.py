"""PyTorch Lightning on scikit-learn's digits, data-parallel through ringreduce.

    mpirun -np 2 python examples/lightning_train.py
    mpirun -np 2 python examples/lightning_train.py --epochs 14 --resume   # from last.ckpt

A plain Lightning script: the only ringreduce lines are the import and
``Trainer(strategy="ringreduce")``. Lightning gives each rank its share of the training
set (a DistributedSampler), ringreduce averages the gradients before the step, the
metrics logged with ``sync_dist=True`` are averaged over the ranks, and rank 0 alone
writes the checkpoints (``last.ckpt`` after every epoch). On GPUs, pass ``--accelerator
gpu``: each rank trains on GPU ``local_rank()``.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Sequence
from typing import Optional

import lightning.pytorch as pl
import torch
from _digits import digits_split
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringreduce.lightning  # noqa: F401 - registers strategy="ringreduce" (and "horovod")


class DigitsNet(pl.LightningModule):
    """A small CNN; SGD with momentum, the rate decayed by 0.8 after every epoch."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple, idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        return loss

    def test_step(self, batch: tuple, idx: int) -> None:
        x, y = batch
        acc = (self(x).argmax(1) == y).double().mean()
        self.log("test_acc", acc, sync_dist=True)

    def configure_optimizers(self) -> dict:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt,
                "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)}


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    x_train, x_test, y_train, y_test = digits_split(images=True)
    as_set = lambda x, y: TensorDataset(torch.from_numpy(x).permute(0, 3, 1, 2),  # noqa: E731
                                        torch.from_numpy(y))
    return (DataLoader(as_set(x_train, y_train), batch_size=batch_size, shuffle=True),
            DataLoader(as_set(x_test, y_test), batch_size=batch_size))


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Train, test on every rank's share of the test set, and return the test accuracy."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10, help="total epochs (default 10)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
    p.add_argument("--checkpoint-dir", default="lightning_checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from <dir>/last.ckpt")
    p.add_argument("--accelerator", default="cpu", help="cpu (default) or gpu")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, test = loaders(args.batch_size)
    trainer = pl.Trainer(
        strategy="ringreduce", accelerator=args.accelerator, devices=1,
        max_epochs=args.epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True)])
    resume = os.path.join(args.checkpoint_dir, "last.ckpt") if args.resume else None
    trainer.fit(DigitsNet(args.lr), train, ckpt_path=resume)
    acc = trainer.test(trainer.lightning_module, test, verbose=False)[0]["test_acc"]
    if trainer.is_global_zero:
        print(f"epochs {trainer.current_epoch}, final test accuracy: {acc:.4f}", flush=True)
    return acc


if __name__ == "__main__":
    main()
