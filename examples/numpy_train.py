"""Data-parallel training of a small numpy MLP on scikit-learn's digits with ringreduce.

Run with any number of processes; the result does not depend on it::

    mpirun -np 2 python examples/numpy_train.py
    mpirun -np 2 python examples/numpy_train.py --resume      # continue from checkpoints/

The model is 64 -> 128 -> 10 (ReLU, softmax cross-entropy) with hand-written backprop and
plain SGD. The *global* batch size is fixed and split evenly across ranks, and gradients are
averaged with ``rr.allreduce(..., op=rr.Average)``, so every step is the same mean-gradient
step as a single process on the whole global batch: ``-np 1`` and ``-np 2`` follow the same
math up to floating-point summation order.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import ringreduce as rr
from ringreduce.checkpoint import atomic_write

Params = dict[str, np.ndarray]

#: Parameter names in a fixed order: every rank issues collectives in this order with these names.
PARAM_NAMES = ("W1", "b1", "W2", "b2")
IN_DIM, HIDDEN_DIM, OUT_DIM = 64, 128, 10
DTYPE = np.float32
#: The train/test split never changes, whatever --seed is, so accuracies are comparable.
SPLIT_SEED = 0
TEST_FRACTION = 0.2
CKPT_NAME = "ckpt.npz"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns
    -------
    argparse.Namespace
        The parsed flags.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15, help="total epochs to train (default 15)")
    p.add_argument(
        "--lr", type=float, default=0.5, help="SGD learning rate per global batch (default 0.5)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="global batch size, split evenly across ranks (default 64)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights and shuffling")
    p.add_argument(
        "--checkpoint-dir",
        default="checkpoints",
        help=f"directory where rank 0 writes {CKPT_NAME} after every epoch (default checkpoints/)",
    )
    p.add_argument(
        "--resume", action="store_true", help="resume from <checkpoint-dir>/" + CKPT_NAME
    )
    args = p.parse_args(argv)
    if args.epochs < 0:
        p.error("--epochs must be >= 0")
    if args.lr <= 0:
        p.error("--lr must be > 0")
    if args.batch_size <= 0:
        p.error("--batch-size must be > 0")
    return args


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load the bundled digits dataset and split it with a fixed seed.

    Returns
    -------
    x_train, y_train, x_test, y_test : numpy.ndarray
        Features scaled to [0, 1] as ``DTYPE`` and integer labels. Identical on every rank.
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(DTYPE)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y
    )
    return x_train, y_train, x_test, y_test


def init_params(rng: np.random.Generator) -> Params:
    """Create He-initialised MLP parameters.

    Parameters
    ----------
    rng : numpy.random.Generator
        Source of the random weights.

    Returns
    -------
    dict of str to numpy.ndarray
        ``W1`` (64, 128), ``b1`` (128,), ``W2`` (128, 10), ``b2`` (10,), C-contiguous.
    """
    return {
        "W1": (rng.standard_normal((IN_DIM, HIDDEN_DIM)) * np.sqrt(2.0 / IN_DIM)).astype(DTYPE),
        "b1": np.zeros(HIDDEN_DIM, dtype=DTYPE),
        "W2": (rng.standard_normal((HIDDEN_DIM, OUT_DIM)) * np.sqrt(1.0 / HIDDEN_DIM)).astype(
            DTYPE
        ),
        "b2": np.zeros(OUT_DIM, dtype=DTYPE),
    }


def forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the MLP forward.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Model parameters.
    x : numpy.ndarray
        Inputs, shape (n, 64).

    Returns
    -------
    pre, hidden, logits : numpy.ndarray
        Hidden pre-activations (n, 128), ReLU outputs (n, 128) and logits (n, 10).
    """
    pre = x @ params["W1"] + params["b1"]
    hidden = np.maximum(pre, 0)
    return pre, hidden, hidden @ params["W2"] + params["b2"]


def loss_and_grads(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Mean softmax cross-entropy over a local batch and its gradients.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Model parameters.
    x : numpy.ndarray
        Local batch inputs, shape (n, 64).
    y : numpy.ndarray
        Local batch labels, shape (n,).

    Returns
    -------
    loss : float
        Mean cross-entropy over the local batch.
    grads : dict of str to numpy.ndarray
        Gradient of the *mean* loss for each parameter (same keys and shapes as ``params``).
    """
    n = x.shape[0]
    pre, hidden, logits = forward(params, x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(n), y].mean())

    d_logits = np.exp(log_probs)
    d_logits[np.arange(n), y] -= 1
    d_logits /= n
    d_hidden = d_logits @ params["W2"].T
    d_hidden[pre <= 0] = 0
    grads = {
        "W1": x.T @ d_hidden,
        "b1": d_hidden.sum(axis=0),
        "W2": hidden.T @ d_logits,
        "b2": d_logits.sum(axis=0),
    }
    return loss, {k: np.ascontiguousarray(g, dtype=DTYPE) for k, g in grads.items()}


def broadcast_params(params: Params, root_rank: int = 0) -> None:
    """Overwrite every rank's parameters, in place, with those of ``root_rank``.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Parameters to synchronise; modified in place on non-root ranks.
    root_rank : int, optional
        Rank whose values win.
    """
    for k in PARAM_NAMES:
        rr.broadcast_(params[k], root_rank, name=f"param.{k}")


def shard_batches(n_train: int, global_batch: int, seed: int, epoch: int) -> list[np.ndarray]:
    """This rank's sample indices for each step of an epoch.

    The permutation depends only on ``(seed, epoch)``, so it is the same on every rank and
    after a resume. Rank ``r`` takes ``perm[r::size]`` (like ``DistributedSampler``) and cuts it
    into per-rank batches of ``global_batch // size``; the union over ranks of step ``k``'s
    batches is exactly ``perm[k * global_batch:(k + 1) * global_batch]``, the batch a single
    process would use. The last incomplete global batch is dropped.

    Parameters
    ----------
    n_train : int
        Number of training samples.
    global_batch : int
        Global batch size; divisible by ``rr.size()``.
    seed : int
        Base seed.
    epoch : int
        Epoch index (0-based).

    Returns
    -------
    list of numpy.ndarray
        One index array of length ``global_batch // rr.size()`` per step.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(n_train)
    local_batch = global_batch // rr.size()
    shard = perm[rr.rank() :: rr.size()]
    steps = n_train // global_batch
    return [shard[i * local_batch : (i + 1) * local_batch] for i in range(steps)]


def evaluate(params: Params, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """Test accuracy over the whole test set, each rank scoring its ``rank::size`` shard.

    Collective: every rank must call it.

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        Model parameters (identical on every rank).
    x_test, y_test : numpy.ndarray
        The full test set (identical on every rank).

    Returns
    -------
    float
        Correct predictions over test samples, summed over all ranks.
    """
    x, y = x_test[rr.rank() :: rr.size()], y_test[rr.rank() :: rr.size()]
    correct = int((forward(params, x)[2].argmax(axis=1) == y).sum()) if len(y) else 0
    totals = rr.allreduce(np.array([correct, len(y)], dtype=np.int64), op=rr.Sum, name="eval")
    return float(totals[0]) / float(max(int(totals[1]), 1))


def save_checkpoint(ckpt_dir: str, params: Params, epoch: int) -> None:
    """Atomically write ``<ckpt_dir>/ckpt.npz``: temp file, fsync, rename, fsync the directory.

    A crash at any point leaves either the previous checkpoint or the new one, never a torn file.

    Parameters
    ----------
    ckpt_dir : str
        Directory to write into; created if missing.
    params : dict of str to numpy.ndarray
        Parameters to save.
    epoch : int
        Number of completed epochs.
    """
    path = os.path.join(ckpt_dir, CKPT_NAME)
    atomic_write(path, lambda f: np.savez(f, epoch=np.int64(epoch), **params))


def load_checkpoint(path: str, params: Params) -> int:
    """Read a checkpoint into ``params`` in place (rank 0 only).

    Parameters
    ----------
    path : str
        Path of the ``.npz`` file.
    params : dict of str to numpy.ndarray
        Parameters to overwrite; shapes must match.

    Returns
    -------
    int
        Number of epochs the checkpoint had completed.
    """
    with np.load(path) as data:
        for k in PARAM_NAMES:
            if data[k].shape != params[k].shape:
                got, want = data[k].shape, params[k].shape
                raise ValueError(f"{path}: {k} has shape {got}, expected {want}")
            params[k][...] = data[k]
        return int(data["epoch"])


def resume(ckpt_dir: str, params: Params) -> int:
    """Resume every rank identically from rank 0's checkpoint.

    Rank 0 loads the file and broadcasts the outcome; on failure (e.g. missing file) every rank
    raises the same error instead of some ranks hanging in the next collective.

    Parameters
    ----------
    ckpt_dir : str
        Directory holding ``ckpt.npz``.
    params : dict of str to numpy.ndarray
        Overwritten in place on every rank with the checkpointed values.

    Returns
    -------
    int
        Number of completed epochs to start from.
    """
    path = os.path.join(ckpt_dir, CKPT_NAME)
    meta: dict = {"epoch": 0, "error": None}
    if rr.rank() == 0:
        if not os.path.isfile(path):
            meta["error"] = f"--resume given but no checkpoint found at {path!r}"
        else:
            try:
                meta["epoch"] = load_checkpoint(path, params)
            except Exception as e:  # any failure must reach every rank
                meta["error"] = f"cannot load checkpoint {path!r}: {type(e).__name__}: {e}"
    meta = rr.broadcast_object(meta, root_rank=0)
    if meta["error"] is not None:
        kind = FileNotFoundError if meta["error"].startswith("--resume") else RuntimeError
        raise kind(f"[rank {rr.rank()}] {meta['error']}")
    broadcast_params(params)
    return int(meta["epoch"])


def checkpoint_all(ckpt_dir: str, params: Params, epoch: int) -> None:
    """Rank 0 saves; every rank learns whether it worked and raises together if not.

    Parameters
    ----------
    ckpt_dir : str
        Checkpoint directory.
    params : dict of str to numpy.ndarray
        Parameters to save.
    epoch : int
        Number of completed epochs.
    """
    error = None
    if rr.rank() == 0:
        try:
            save_checkpoint(ckpt_dir, params, epoch)
        except OSError as e:
            error = f"cannot write checkpoint to {ckpt_dir!r}: {e}"
    error = rr.broadcast_object(error, root_rank=0)
    if error is not None:
        raise OSError(f"[rank {rr.rank()}] {error}")


def train(args: argparse.Namespace) -> float:
    """Train and evaluate; ``rr`` must be initialised.

    Parameters
    ----------
    args : argparse.Namespace
        Flags from :func:`parse_args`.

    Returns
    -------
    float
        Final test accuracy (the same on every rank).
    """
    rank, size = rr.rank(), rr.size()
    if args.batch_size % size:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by {size} ranks")
    x_train, y_train, x_test, y_test = load_data()
    if len(x_train) < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} exceeds {len(x_train)} train samples")

    # Deliberately different weights on each rank: only the broadcast makes them agree.
    params = init_params(np.random.default_rng([args.seed, rank]))
    start_epoch = resume(args.checkpoint_dir, params) if args.resume else 0
    if not args.resume:
        broadcast_params(params)

    # Learning rate: Horovod's convention scales lr by size() because there each rank keeps a
    # fixed per-rank batch, so the global batch (and the averaged gradient's noise scale) grows
    # with the number of ranks. Here the *global* batch is fixed and split across ranks, so
    # every step averages the same number of samples at any size and args.lr is used unscaled.
    lr = args.lr
    steps = len(x_train) // args.batch_size
    bar = tqdm(
        total=args.epochs * steps,
        initial=min(start_epoch, args.epochs) * steps,
        disable=rank != 0,
        desc=f"train x{size}",
        unit="step",
    )
    for epoch in range(start_epoch, args.epochs):
        loss_sum = 0.0
        for idx in shard_batches(len(x_train), args.batch_size, args.seed, epoch):
            loss, grads = loss_and_grads(params, x_train[idx], y_train[idx])
            loss_sum += loss
            for k in PARAM_NAMES:
                params[k] -= lr * rr.allreduce(grads[k], op=rr.Average, name=f"grad.{k}")
            bar.update(1)
        mean_loss = rr.allreduce(np.array([loss_sum / steps]), op=rr.Average, name="epoch_loss")
        acc = evaluate(params, x_test, y_test)
        bar.set_postfix(epoch=epoch + 1, loss=f"{float(mean_loss[0]):.4f}", test_acc=f"{acc:.3f}")
        checkpoint_all(args.checkpoint_dir, params, epoch + 1)
    bar.close()
    return evaluate(params, x_test, y_test)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Entry point: initialise ringreduce (unless already), train, report on rank 0.

    Parameters
    ----------
    argv : sequence of str, optional
        Command-line arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns
    -------
    float
        Final test accuracy.
    """
    args = parse_args(argv)
    owns_init = not rr.is_initialized()
    if owns_init:
        rr.init()
    try:
        acc = train(args)
        if rr.rank() == 0:
            print(f"final test accuracy: {acc:.3f}", flush=True)
        return acc
    finally:
        if owns_init:
            rr.shutdown()


if __name__ == "__main__":
    main()
