"""Horovod's model-parallel local layers at -np 2, every case in one TensorFlow process per rank.

    mpirun -np 2 python partial_worker.py

Model: x (3) -> Dense(4, tanh) -> Dense(1), float64, MSE; rank r trains on its own rows. The
first layer is local: its gradients are not averaged. Each case runs three SGD steps and logs
``case`` events comparing, on this rank, the shared weights with a reference of averaged
gradients and the local weights with the same rank's local-only gradients (divided by
``size()`` when scaling, as Horovod does), both computed here in plain TensorFlow for every
rank's rows (no ringreduce), and the spread of both across ranks. Then registrations that
differ between ranks (``mismatch``) and bad ``local_layers`` arguments (``bad-args``).
"""

from __future__ import annotations

import sys

import keras
import numpy as np
import tensorflow as tf
from workerlib import error_event, event, run, say, set_rank

import ringreduce.keras as rrk
import ringreduce.tensorflow as rr

keras.backend.set_floatx("float64")
LR, STEPS, ROWS = 0.1, 3, 6
SHARDS = [(np.random.default_rng(100 + r).normal(size=(ROWS, 3)),
           np.random.default_rng(200 + r).normal(size=(ROWS, 1))) for r in range(2)]
NAMES = ("W1", "b1", "W2", "b2")  # the first two are the local layer's


def forward(p: dict, x: tf.Tensor) -> tf.Tensor:
    return tf.tanh(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]


def mse(y: tf.Tensor, pred: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(pred - y))


def initial() -> list:
    keras.utils.set_random_seed(7)
    return [np.asarray(w) for w in make_model().get_weights()]


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def reference(start: list, scale: bool) -> tuple:
    """(shared weights, every rank's local weights) after STEPS steps of SGD, where the
    shared gradient is the ranks' mean and each rank's local one is its own (over size)."""
    n = rr.size()
    shared = {k: tf.Variable(v) for k, v in zip(NAMES[2:], start[2:])}
    local = [{k: tf.Variable(v) for k, v in zip(NAMES[:2], start[:2])} for _ in range(n)]
    for _ in range(STEPS):
        grads = []
        for r in range(n):
            with tf.GradientTape() as tape:
                loss = mse(SHARDS[r][1], forward({**local[r], **shared}, SHARDS[r][0]))
            grads.append(tape.gradient(loss, {**local[r], **shared}))
        for r in range(n):
            for k in NAMES[:2]:
                local[r][k].assign_sub(LR * grads[r][k] / (n if scale else 1))
        for k in NAMES[2:]:
            shared[k].assign_sub(LR * sum(g[k] for g in grads) / n)
    return ([shared[k].numpy() for k in NAMES[2:]],
            [[loc[k].numpy() for k in NAMES[:2]] for loc in local])


def flat(arrays: list) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(a)) for a in arrays])


def report(case: str, weights: list, scale: bool, start: list) -> None:
    """Compare this rank's weights (W1, b1, W2, b2) with the reference and with the peers."""
    shared_ref, local_ref = reference(start, scale)
    _, other_local = reference(start, not scale)
    mine = local_ref[rr.rank()]
    everyone = rr.allgather_object([np.asarray(w) for w in weights])
    event("case", case=case, scale=scale,
          shared_ref=float(np.abs(flat(weights[2:]) - flat(shared_ref)).max()),
          local_ref=float(np.abs(flat(weights[:2]) - flat(mine)).max()),
          local_other_scaling=float(np.abs(flat(weights[:2]) - flat(
              other_local[rr.rank()])).max()),
          shared_spread=float(np.abs(flat(everyone[0][2:]) - flat(everyone[1][2:])).max()),
          local_spread=float(np.abs(flat(everyone[0][:2]) - flat(everyone[1][:2])).max()))


def tape_case(start: list, scale: bool, direct: bool, graph: bool) -> None:
    """PartialDistributedGradientTape(local_layers=...) or DistributedGradientTape with
    register_local_source; applied with a plain Keras SGD."""
    model = make_model()
    model.set_weights(start)
    opt = keras.optimizers.SGD(LR)
    x, y = SHARDS[rr.rank()]
    local = model.layers[0]

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = mse(y, model(x))
        if direct:
            tape = rr.DistributedGradientTape(tape, scale_local_gradients=scale)
            for v in local.trainable_weights:
                tape.register_local_source(v)
        else:
            tape = rr.PartialDistributedGradientTape(tape, local_layers=local,
                                                     scale_local_gradients=scale)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    run_step = tf.function(step) if graph else step
    for _ in range(STEPS):
        run_step()
    name = ("register_local_source" if direct else "partial_tape") + \
        (".function" if graph else ".eager")
    report(name, model.get_weights(), scale, start)


def keras_case(start: list, scale: bool, how: str) -> None:
    """ringreduce.keras.PartialDistributedOptimizer in a custom loop or model.fit, or
    DistributedOptimizer with register_local_var."""
    model = make_model()
    model.set_weights(start)
    x, y = SHARDS[rr.rank()]
    local = model.layers[0]
    if how == "register_local_var.fit":
        opt = rrk.DistributedOptimizer(keras.optimizers.SGD(LR), scale_local_gradients=scale)
        for v in local.trainable_weights:
            opt.register_local_var(v)
    else:  # one layer here, a list of one in fit (both forms of local_layers)
        opt = rrk.PartialDistributedOptimizer(
            keras.optimizers.SGD(LR), local_layers=local if how == "loop" else [local],
            scale_local_gradients=scale)
    if how == "loop":
        @tf.function
        def step() -> None:
            with tf.GradientTape() as tape:
                loss = mse(y, model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for _ in range(STEPS):
            step()
    else:
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=ROWS, epochs=STEPS, shuffle=False, verbose=0)
    report(f"keras.{how}", model.get_weights(), scale, start)


def tf1_case(start: list, scale: bool) -> None:
    """The TF1 DistributedOptimizer (a tf.compat.v1 graph) with register_local_var."""
    x, y = SHARDS[rr.rank()]
    with tf.Graph().as_default():
        p = {k: tf.compat.v1.get_variable(k, initializer=v, use_resource=True)
             for k, v in zip(NAMES, start)}
        loss = mse(tf.constant(y), forward(p, tf.constant(x)))
        opt = rr.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                      scale_local_gradients=scale)
        opt.register_local_var(p["W1"])
        opt.register_local_var(p["b1"])
        train = opt.minimize(loss, var_list=[p[k] for k in NAMES])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(train)
            weights = sess.run([p[k] for k in NAMES])
    report("tf1", weights, scale, start)


def mismatch() -> None:
    """Rank 0 registers a, rank 1 registers b (same shape): a MismatchError everywhere,
    never rank 0's gradient of b averaged with rank 1's gradient of a."""
    a = tf.Variable([1.0, 2.0])
    b = tf.Variable([3.0, 4.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * (rr.rank() + 1.0)) + tf.reduce_sum(b * 10.0 * (rr.rank() + 1))
    tape = rr.DistributedGradientTape(tape)
    tape.register_local_source(a if rr.rank() == 0 else b)
    try:
        grads = tape.gradient(loss, [a, b])
    except Exception as err:  # noqa: BLE001 - the class is what is checked
        error_event("mismatch", err)
        return
    event("mismatch", error=None, grads=[np.asarray(g).tolist() for g in grads])


def bad_args() -> None:
    """local_layers that are neither a layer nor a list of layers."""
    out = {}
    layer = keras.layers.Dense(2)
    for label, value in [("str", "dense"), ("int", 3), ("list-with-int", [layer, 3]),
                         ("dict", {"a": layer})]:
        for what in ("tape", "optimizer"):
            try:
                if what == "tape":
                    with tf.GradientTape() as tape:
                        pass
                    rr.PartialDistributedGradientTape(tape, local_layers=value)
                else:
                    rrk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    local_layers=value)
                out[f"{what}.{label}"] = None
            except Exception as err:  # noqa: BLE001
                out[f"{what}.{label}"] = [type(err).__name__, str(err)]
    event("bad-args", **out)


def main() -> None:
    rr.init()
    set_rank(rr.rank())
    start = initial()
    tape_case(start, True, direct=False, graph=True)
    tape_case(start, False, direct=True, graph=False)
    keras_case(start, True, "loop")
    keras_case(start, True, "fit")
    keras_case(start, False, "register_local_var.fit")
    tf1_case(start, True)
    bad_args()
    if "no-mismatch" not in sys.argv:
        mismatch()
    rr.barrier()
    say(f"OK rank {rr.rank()}")
    rr.shutdown()


if __name__ == "__main__":
    run(main)
