"""Data-parallel JAX + optax training: an MLP on scikit-learn's 8x8 digits.

    mpirun -np 2 python examples/jax_train.py [--epochs 20] [--resume]

The ringreduce recipe for JAX: ``hvd.init()``; every rank builds the same model and
``broadcast_parameters`` makes rank 0's initial weights everyone's; the optax optimizer
is wrapped in ``hvd.DistributedOptimizer`` (gradients averaged over ranks inside the
jitted step) with its learning rate scaled by ``size()``; each rank trains on its own
shard of every epoch's shuffled batches; metrics are averaged with ``hvd.allreduce``;
rank 0 alone writes the checkpoint (atomically), and ``--resume`` reads it on rank 0 and
broadcasts it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _digits import digits_split, parse_args, train_and_report

import ringreduce.jax as hvd


def init_params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 128)) * (2 / 64) ** 0.5, "b1": jnp.zeros(128),
            "w2": jax.random.normal(k2, (128, 10)) * (1 / 128) ** 0.5, "b2": jnp.zeros(10)}


def logits(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def make_step(tx: optax.GradientTransformation) -> Any:
    @jax.jit
    def step(params: dict, state: optax.OptState, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)  # averaged over ranks in here
        return optax.apply_updates(params, updates), state, loss

    return step


def resume(args: Any, params: dict, state: Any) -> tuple[dict, Any, int]:
    """The checkpoint's params, optimizer state and epoch, or the fresh ones (collective)."""
    path = os.path.join(args.checkpoint_dir, "ckpt.pkl")
    saved = hvd.load_checkpoint(path, missing_ok=True) if args.resume else None
    if saved is None:
        return params, state, 0
    return saved["params"], saved["opt_state"], int(saved["epoch"])


def train(args: Any) -> float:
    x_train, x_test, y_train, y_test = digits_split(images=False)
    rank, size = hvd.rank(), hvd.size()
    params = hvd.broadcast_parameters(init_params(jax.random.key(args.seed + rank)), 0)
    tx = hvd.DistributedOptimizer(optax.adam(args.lr * size))
    params, state, start = resume(args, params, tx.init(params))
    step = make_step(tx)
    per_step = args.batch_size * size
    rng = np.random.default_rng(args.seed)
    for epoch in range(start, args.epochs):
        order = rng.permutation(len(x_train))  # the same on every rank: shards are disjoint
        losses = []
        for i in range(0, len(order) - per_step + 1, per_step):
            mine = order[i + rank * args.batch_size:i + (rank + 1) * args.batch_size]
            params, state, loss = step(params, state, x_train[mine], y_train[mine])
            losses.append(loss)
        mean_loss = float(hvd.allreduce(jnp.mean(jnp.stack(losses)), name="loss"))
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {mean_loss:.4f}", flush=True)
        hvd.save_checkpoint(os.path.join(args.checkpoint_dir, "ckpt.pkl"), params=params,
                            opt_state=state, epoch=epoch + 1)
    shard = np.arange(rank, len(x_test), size)  # every rank scores its share of the test set
    correct = jnp.sum(jnp.argmax(logits(params, x_test[shard]), -1) == y_test[shard])
    return float(hvd.allreduce(correct.astype(jnp.float32), op=hvd.Sum)) / len(x_test)


def main(argv: Optional[Sequence[str]] = None) -> float:
    args = parse_args(argv, __doc__, epochs=20, lr=1e-3, optimizer="Adam",
                      checkpoint_dir="checkpoints-jax",
                      checkpoint_help="where rank 0 writes ckpt.pkl every epoch",
                      resume_help="continue from the checkpoint in --checkpoint-dir")
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    hvd.init()
    return train_and_report(hvd, train, args)


if __name__ == "__main__":
    main()
