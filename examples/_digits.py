"""What the TensorFlow/Keras examples share: the digits split and the run-and-report frame."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

#: The train/test split never changes, whatever --seed is, so accuracies are comparable.
SPLIT_SEED = 0


def digits_split(images: bool) -> tuple[np.ndarray, ...]:
    """scikit-learn's digits in [0, 1] (8x8x1 images, or 64 features) with int labels:
    ``x_train, x_test, y_train, y_test`` (a stratified 80/20 split, the same everywhere)."""
    digits = load_digits()
    x = (digits.images[..., None] if images else digits.data) / 16.0
    return tuple(train_test_split(x.astype(np.float32), digits.target.astype(np.int64),
                                  test_size=0.2, random_state=SPLIT_SEED,
                                  stratify=digits.target))


def pin_threads(tf: Any, local_size: int) -> None:
    """Share the cores between the ranks on this host. Once TensorFlow has run an op in this
    process (a notebook, an earlier training) its thread pools are fixed: they stay."""
    import os

    threads = max(1, (os.cpu_count() or 1) // local_size)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # "cannot be modified after initialization"
        pass


def train_and_report(rr: Any, train: Callable[[Any], float], args: Any) -> float:
    """Run ``train(args)`` (ringreduce initialised), print the accuracy on rank 0, shut down."""
    try:
        acc = train(args)
        if rr.rank() == 0:
            print(f"final test accuracy: {acc:.4f}", flush=True)
        return acc
    finally:
        rr.shutdown()


def parse_args(argv: Optional[Sequence[str]], doc: str, epochs: int, lr: float, optimizer: str,
               checkpoint_dir: str, checkpoint_help: str,
               resume_help: Optional[str] = None) -> argparse.Namespace:
    """The examples' flags: --epochs, --batch-size (per rank), --lr (for one rank, scaled by
    size()), --seed, --checkpoint-dir and, with ``resume_help``, --resume."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--epochs", type=int, default=epochs, help=f"total epochs (default {epochs})")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument("--lr", type=float, default=lr, help=f"{optimizer} learning rate for one "
                   f"rank; multiplied by size() (default {lr:g})")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument("--checkpoint-dir", default=checkpoint_dir, help=checkpoint_help)
    if resume_help:
        p.add_argument("--resume", action="store_true", help=resume_help)
    args = p.parse_args(argv)
    if args.epochs < 0 or args.batch_size <= 0 or args.lr <= 0:
        p.error("--epochs must be >= 0, --batch-size and --lr > 0")
    return args
