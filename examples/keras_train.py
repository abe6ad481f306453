"""Data-parallel Keras 3 training of a small CNN on scikit-learn's digits with ringreduce.keras.

Run with any number of processes::

    mpirun -np 2 python examples/keras_train.py
    mpirun -np 2 python examples/keras_train.py --resume       # continue from checkpoints/
    mpirun -np 2 python examples/keras_train.py --resume --epochs 12   # two more epochs

Horovod's Keras recipe: the training set is sharded by rank (rank r takes rows
r::size), every rank keeps a fixed per-rank batch so the learning rate is scaled by
``size()`` and warmed up over the first epochs, ``DistributedOptimizer`` averages the
gradients of every step, ``BroadcastGlobalVariablesCallback`` starts every rank from
rank 0's weights, ``MetricAverageCallback`` averages the logged metrics, and rank 0
alone writes ``<checkpoint-dir>/ckpt.keras`` (atomically) after every epoch, then
``ckpt.json`` holding the number of finished epochs. ``--resume`` loads the model
with its optimizer on every rank from rank 0's file (``rr.load_model``) and continues
with the next epoch; a finished run is not trained further.

Measured on 2 CPU cores (defaults: 10 epochs, per-rank batch 32; TensorFlow 2.21,
Keras 3.15), final test accuracy and wall clock (which includes ~5 s of TensorFlow
import per process): ``-np 1``: 0.978 (0.978-0.981 over --seed 0, 1, 2), about 8 s;
``-np 2``: 0.978 (0.978 for all three seeds), about 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from _digits import digits_split, pin_threads, train_and_report
from _digits import parse_args as common_args

import ringreduce.keras as rr
from ringreduce.checkpoint import atomic_write

CKPT_NAME = "ckpt.keras"
STATE_NAME = "ckpt.json"
WARMUP_EPOCHS = 2


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags (``argv`` without the program name; None: sys.argv)."""
    return common_args(argv, __doc__, 10, 2e-3, "Adam", "checkpoints",
                       f"where rank 0 writes {CKPT_NAME} and {STATE_NAME} after every epoch",
                       f"resume from <dir>/{CKPT_NAME} and <dir>/{STATE_NAME}")


def load_data() -> tuple[np.ndarray, ...]:
    """x_train, y_train, x_test, y_test, with this rank's shard of the training set (the
    same length on every rank)."""
    xtr, xte, ytr, yte = digits_split(images=True)
    n = len(xtr) // rr.size()  # equal shards: every rank runs the same number of steps
    mine = slice(rr.rank(), None, rr.size())
    return xtr[mine][:n], ytr[mine][:n], xte, yte


def build_model(lr: float) -> keras.Model:
    """The CNN (~38 k parameters), compiled with the distributed Adam (``lr``: already
    scaled by size())."""
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    opt = rr.DistributedOptimizer(keras.optimizers.Adam(lr))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class SaveEpoch(keras.callbacks.Callback):
    """Rank 0 writes ``{"epoch": finished epochs}`` atomically after each epoch.

    Placed after ModelCheckpoint, so the file never counts an epoch whose weights are
    not saved yet (a crash between the two writes makes a resume redo one epoch).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        """Record ``epoch + 1`` finished epochs."""
        if rr.rank() == 0:
            text = json.dumps({"epoch": epoch + 1}).encode()
            atomic_write(self.path, lambda f: f.write(text))


def read_epoch(path: str) -> int:
    """The finished epochs recorded in ``path``, read on rank 0. Collective: every rank
    gets the number, or raises the same CheckpointError."""
    state = None
    if rr.rank() == 0:
        try:
            with open(path) as f:
                state = int(json.load(f)["epoch"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            state = f"rank 0 cannot read {path!r}: {err!r}"
    state = rr.broadcast_object(state, root_rank=0)
    if isinstance(state, str):
        raise rr.CheckpointError(state)
    return state


def setup(args: argparse.Namespace) -> tuple[keras.Model, int]:
    """The model (the same on every rank once ``fit`` starts) and the start epoch."""
    lr = args.lr * rr.size()
    if not args.resume:
        return build_model(lr), 0
    # Collective: rank 0 reads the file and every rank loads the same bytes; the
    # restored optimizer (with its state and learning rate) is distributed again.
    model = rr.load_model(os.path.join(args.checkpoint_dir, CKPT_NAME))
    start = read_epoch(os.path.join(args.checkpoint_dir, STATE_NAME))
    if start >= WARMUP_EPOCHS:  # the rate for this run's size() (resumes may change -np)
        model.optimizer.learning_rate = lr
    return model, start


def evaluate(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy over the whole test set; each rank scores its rank::size share. Collective."""
    xs, ys = x[rr.rank()::rr.size()], y[rr.rank()::rr.size()]
    pred = model.predict(xs, batch_size=256, verbose=0).argmax(1) if len(ys) else ys
    counts = rr.allgather_object((int((pred == ys).sum()), len(ys)))
    return sum(c for c, _ in counts) / max(sum(n for _, n in counts), 1)


def train(args: argparse.Namespace) -> float:
    """Train and evaluate (ringreduce initialised); returns the final test accuracy."""
    xtr, ytr, xte, yte = load_data()
    keras.utils.set_random_seed(args.seed + rr.rank())  # weights differ: the broadcast fixes it
    model, start = setup(args)
    ckpt = os.path.join(args.checkpoint_dir, CKPT_NAME)
    callbacks = [
        rr.callbacks.BroadcastGlobalVariablesCallback(0),
        rr.callbacks.MetricAverageCallback(),  # before the callbacks that read metrics
        rr.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * rr.size(),
                                                warmup_epochs=WARMUP_EPOCHS),
        rr.callbacks.ModelCheckpoint(ckpt),  # on every rank: rank 0 alone writes
        SaveEpoch(os.path.join(args.checkpoint_dir, STATE_NAME)),
    ]
    if start < args.epochs:
        model.fit(xtr, ytr, batch_size=args.batch_size, epochs=args.epochs,
                  initial_epoch=start, callbacks=callbacks,
                  verbose=2 if rr.rank() == 0 else 0)
    elif rr.rank() == 0:
        print(f"checkpoint already has {start} epochs (--epochs {args.epochs}): "
              "nothing to train", flush=True)
    return evaluate(model, xte, yte)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Entry point: initialise, train, print the final accuracy on rank 0."""
    args = parse_args(argv)
    rr.init()
    pin_threads(tf, rr.local_size())
    return train_and_report(rr, train, args)

if __name__ == "__main__":
    main()
