"""A TF1-style graph (placeholders, MonitoredTrainingSession) on scikit-learn's digits.

Run with any number of processes::

    mpirun -np 2 python examples/tf1_monitored_session.py

The classic distributed-TensorFlow tutorial through ``tf.compat.v1`` with
ringreduce.tensorflow (Horovod's TF1 recipe): eager execution is disabled, a
64-128-10 MLP is built from ``tf.compat.v1.get_variable``, the Adagrad optimizer is
wrapped in ``rr.DistributedOptimizer`` (gradients averaged over all ranks inside
``train_op``; learning rate scaled by ``size()``), ``rr.BroadcastGlobalVariablesHook(0)``
copies rank 0's variables to every rank once the session exists, and
``StopAtStepHook`` ends training after the same number of global steps on every
rank: each rank feeds its own shard of the training set, so ``size()`` ranks need
``1/size()`` of the steps for the same number of epochs. Only rank 0 passes a
``checkpoint_dir``: it alone writes checkpoints, and running the script again with
the same ``--checkpoint-dir`` resumes from rank 0's latest one (TensorFlow restores
it on rank 0, the hook broadcasts it, ``global_step`` included); a finished run is not
trained further. At the end every rank scores its share of the test set and one
in-graph ``rr.allreduce`` sums the counts.

Measured on 2 CPU cores (defaults: 15 epochs, per-rank batch 32; TensorFlow 2.21),
final test accuracy and wall clock (which includes ~5 s of TensorFlow import per
process): ``-np 1``: 0.975 (0.975-0.978 over --seed 0, 1, 2), about 5 s;
``-np 2``: 0.975 (0.975 for all three seeds), about 5 s.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
from _digits import digits_split, train_and_report
from _digits import parse_args as common_args

import ringreduce.tensorflow as rr


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse command-line flags (``argv`` without the program name; None: sys.argv)."""
    return common_args(argv, __doc__, 15, 0.2, "Adagrad", "checkpoints_tf1",
                       "where rank 0 writes TensorFlow checkpoints (and resumes from)")


def load_data() -> tuple[np.ndarray, ...]:
    """The digits as 64 floats in [0, 1] and int labels: x_train, x_test, y_train, y_test."""
    return digits_split(images=False)


def batches(n: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """This rank's batches of sample indices, epoch after epoch (full batches only).

    Each epoch's permutation depends only on (seed, epoch), the same on every rank;
    rank r takes perm[r::size], so every rank gets the same number of batches.
    """
    for epoch in range(1 << 30):
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        mine = perm[rr.rank()::rr.size()][: n // rr.size()]
        for i in range(0, len(mine) - batch + 1, batch):
            yield mine[i:i + batch]


def build_graph(lr: float) -> dict:
    """Placeholders, the MLP, its loss, the distributed train op and the eval ops."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
    y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
    init = tf.compat.v1.glorot_uniform_initializer()
    w1 = tf.compat.v1.get_variable("w1", [64, 128], initializer=init)
    b1 = tf.compat.v1.get_variable("b1", [128], initializer=tf.compat.v1.zeros_initializer())
    w2 = tf.compat.v1.get_variable("w2", [128, 10], initializer=init)
    b2 = tf.compat.v1.get_variable("b2", [10], initializer=tf.compat.v1.zeros_initializer())
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = rr.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(lr))
    train_op = opt.minimize(loss, global_step=global_step)
    # This rank's correct predictions and examples, summed over all ranks in the graph.
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.int64))
    counts = rr.allreduce(tf.stack([correct, tf.size(y, out_type=tf.int64)]), op=rr.Sum,
                          name="eval")
    return {"x": x, "y": y, "loss": loss, "train_op": train_op, "global_step": global_step,
            "counts": counts}


def train(args: argparse.Namespace) -> float:
    """Build the graph, train with a MonitoredTrainingSession, return the test accuracy."""
    xtr, xte, ytr, yte = load_data()
    tf.compat.v1.set_random_seed(args.seed + rr.rank())  # differs: the hook broadcasts rank 0's
    g = build_graph(args.lr * rr.size())
    steps_per_epoch = (len(xtr) // rr.size()) // args.batch_size
    last_step = args.epochs * steps_per_epoch
    hooks = [rr.BroadcastGlobalVariablesHook(0),  # first: the state every rank starts from
             tf.compat.v1.train.StopAtStepHook(last_step=last_step)]
    threads = max(1, (os.cpu_count() or 1) // rr.local_size())
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads,
                                      inter_op_parallelism_threads=threads)
    xs, ys = xte[rr.rank()::rr.size()], yte[rr.rank()::rr.size()]
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=args.checkpoint_dir if rr.rank() == 0 else None, hooks=hooks,
            config=config, save_summaries_steps=None, save_summaries_secs=None,
            log_step_count_steps=None) as sess:
        # Running any op lets StopAtStepHook see a restored global_step that is already done.
        step = int(sess.run(g["global_step"]))
        if rr.rank() == 0:
            print(f"training steps {step} to {last_step} on {rr.size()} rank(s)", flush=True)
        feed = batches(len(xtr), args.batch_size, args.seed)
        for _ in range(step):  # a resumed run continues with the batches it had reached
            next(feed)
        losses = []
        while not sess.should_stop():
            idx = next(feed)
            _, loss = sess.run([g["train_op"], g["loss"]],
                               feed_dict={g["x"]: xtr[idx], g["y"]: ytr[idx]})
            losses.append(loss)
            step += 1  # global_step, as train_op increments it
            if rr.rank() == 0 and step % steps_per_epoch == 0:
                print(f"epoch {step // steps_per_epoch}/{args.epochs}: rank-0 loss "
                      f"{np.mean(losses):.4f}", flush=True)
                losses = []
        # Once a hook requested the stop, sess.run refuses; run_step_fn hands out the
        # raw session (no hooks), still open until the with block ends.
        correct, total = sess.run_step_fn(lambda step_context: step_context.session.run(
            g["counts"], feed_dict={g["x"]: xs, g["y"]: ys}))
    return float(correct) / max(float(total), 1.0)


def main(argv: Optional[Sequence[str]] = None) -> float:
    """Entry point: graph mode, initialise, train, print the final accuracy on rank 0."""
    args = parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    rr.init()
    return train_and_report(rr, train, args)

if __name__ == "__main__":
    main()
