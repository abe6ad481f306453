"""SyncBatchNormalization cases, shared by keras_worker.py (real processes, every Keras
backend) and test_tensorflow_sync_batch_norm.py (ranks as threads, TensorFlow).

Rank r holds 3 + 2r samples (unequal batches); its results, put together in rank order
(outputs, input gradients concatenated; gamma and beta gradients summed: each rank's loss
is its part of the whole batch's), must equal plain BatchNormalization on the whole batch,
step by step, and so must the moving statistics after the steps and the inference output.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np

import ringreduce.keras as rk

# name -> (sample shape, layer arguments, with a mask over all but the last axis)
CASES = {
    "dense": ((3,), {}, False),
    "masked-sequence": ((4, 2), {}, True),
    "channels-first": ((2, 3), {"axis": 1}, False),
}
STEPS = 3


def case_data(name: str, size: int) -> list:
    """Every rank's (x, loss weights, mask or None)."""
    shape, _, masked = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    out = []
    for r in range(size):
        n = 3 + 2 * r
        x = rng.normal(size=(n, *shape)) * (1 + r) + r
        mask = rng.random((n, *shape[:-1])) < 0.7 if masked else None
        out.append((x, rng.normal(size=x.shape), mask))
    return out


def _loss_and_grads(layer: Any, x: np.ndarray, w: np.ndarray, mask: Any,
                    compiled: bool) -> tuple:
    """One training-mode call through ``stateless_call``: (output, new moving statistics,
    gradients of sum(output * w) w.r.t. x, gamma, beta), as numpy."""
    backend = keras.backend.backend()
    moving = [v.value for v in layer.non_trainable_variables]

    keep = None if mask is None else keras.ops.convert_to_tensor(mask)

    def fn(xt: Any, gamma: Any, beta: Any) -> tuple:
        y, stats = layer.stateless_call([gamma, beta], moving, xt, training=True, mask=keep)
        return keras.ops.sum(y * keras.ops.convert_to_tensor(w)), (y, stats)

    params = [keras.ops.convert_to_tensor(x)] + [v.value for v in layer.trainable_variables]
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_step(*ps: Any) -> tuple:
            with tf.GradientTape() as tape:
                tape.watch(ps)
                loss, aux = fn(*ps)
            return aux, tape.gradient(loss, ps)

        (y, stats), grads = (tf.function(tf_step) if compiled else tf_step)(*params)
    elif backend == "torch":
        import torch

        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        loss, (y, stats) = fn(*leaves)
        grads = torch.autograd.grad(loss, leaves)
    else:
        import jax

        step = jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)
        (_, (y, stats)), grads = (jax.jit(step) if compiled else step)(*params)
    return _numpy(y), [_numpy(s) for s in stats], [_numpy(g) for g in grads]


def _numpy(x: Any) -> np.ndarray:
    # a TensorFlow variable or tensor's own .numpy(): keras.ops.convert_to_numpy goes
    # through __array__ there, which numpy 2 warns about (no copy keyword)
    return np.asarray(x.numpy()) if hasattr(x, "numpy") and not hasattr(x, "detach") \
        else keras.ops.convert_to_numpy(x)


def train(layer_cls: type, name: str, x: np.ndarray, w: np.ndarray, mask: Any,
          compiled: bool = False) -> dict:
    """STEPS training-mode calls on x * (step + 1), then the moving statistics and the
    inference output on x."""
    _, args, _ = CASES[name]
    keras.utils.set_random_seed(7)
    layer = layer_cls(momentum=0.5, **args)
    layer.build((None, *x.shape[1:]))
    layer.gamma.assign(np.linspace(0.5, 1.5, layer.gamma.shape[0]))
    layer.beta.assign(np.linspace(-0.2, 0.3, layer.beta.shape[0]))
    outputs, grads = [], []
    for step in range(STEPS):
        y, stats, g = _loss_and_grads(layer, x * (step + 1), w, mask, compiled)
        for v, s in zip(layer.non_trainable_variables, stats):
            v.assign(s)
        outputs.append(y)
        grads.append(g)
    return {"outputs": outputs, "grads": grads,
            "moving": [_numpy(v.value) for v in layer.non_trainable_variables],
            "inference": _numpy(layer(keras.ops.convert_to_tensor(x), training=False))}


def differences(parts: list, ref: dict) -> dict:
    """Largest difference between the ranks' results put together and the reference's."""
    diffs = {"outputs": 0.0, "grad_x": 0.0, "grad_gamma": 0.0, "grad_beta": 0.0,
             "moving": 0.0, "inference": 0.0}

    def worse(key: str, a: np.ndarray, b: np.ndarray) -> None:
        assert a.shape == b.shape, (key, a.shape, b.shape)
        diffs[key] = max(diffs[key], float(np.abs(a - b).max()))

    for s in range(STEPS):
        worse("outputs", np.concatenate([p["outputs"][s] for p in parts]), ref["outputs"][s])
        worse("grad_x", np.concatenate([p["grads"][s][0] for p in parts]), ref["grads"][s][0])
        worse("grad_gamma", sum(p["grads"][s][1] for p in parts), ref["grads"][s][1])
        worse("grad_beta", sum(p["grads"][s][2] for p in parts), ref["grads"][s][2])
    for p in parts:
        for a, b in zip(p["moving"], ref["moving"]):
            worse("moving", a, b)
    worse("inference", np.concatenate([p["inference"] for p in parts]), ref["inference"])
    return diffs


def layer_cases(rank: int, size: int, allgather: Callable[[Any], list],
                compiled: bool = False, names: Any = None) -> dict:
    """The cases ``names`` (default: all) at this rank; returns {case: differences from
    BatchNormalization on the whole batch} (every rank computes them from the gathered
    results)."""
    out = {}
    for name in names or CASES:
        data = case_data(name, size)
        x, w, mask = data[rank]
        parts = allgather(train(rk.SyncBatchNormalization, name, x, w, mask, compiled))
        whole = [np.concatenate([d[i] for d in data]) if data[0][i] is not None else None
                 for i in range(3)]
        out[name] = differences(parts, train(keras.layers.BatchNormalization, name, *whole))
    return out


def single_rank_is_batch_norm() -> float:
    """At size 1 the layer is BatchNormalization: the largest difference (expected 0)."""
    from ringreduce.testing import make_world

    (single,) = make_world(1)
    try:
        with rk.use_communicator(single):
            worst = 0.0
            for name in CASES:
                x, w, mask = case_data(name, 1)[0]
                mine = train(rk.SyncBatchNormalization, name, x, w, mask)
                ref = train(keras.layers.BatchNormalization, name, x, w, mask)
                worst = max(worst, max(differences([mine], ref).values()))
            return worst
    finally:
        single.close()


def fit_equals_one_process(batches: Callable[[int], tuple], x: np.ndarray,
                           y: np.ndarray) -> float:
    """model.fit with SyncBatchNormalization under DistributedOptimizer at np=n on per-rank
    batches of 4 ends with the weights (moving statistics included) of one process with
    BatchNormalization on batches of 4n: the largest difference."""

    def model(bn: type) -> keras.Model:
        keras.utils.set_random_seed(99)
        return keras.Sequential([keras.Input(x.shape[1:]), keras.layers.Dense(4),
                                 bn(momentum=0.7), keras.layers.Activation("tanh"),
                                 keras.layers.Dense(1)])

    def weights(m: keras.Model) -> np.ndarray:
        return np.concatenate([np.ravel(_numpy(v)) for v in m.weights])

    mine = model(rk.SyncBatchNormalization)
    mine.compile(optimizer=rk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)),
                 loss="mse")
    xs, ys = batches(4)
    mine.fit(xs, ys, batch_size=4, epochs=2, shuffle=False, verbose=0,
             callbacks=[rk.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = model(keras.layers.BatchNormalization)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    ref.fit(x, y, batch_size=4 * rk.size(), epochs=2, shuffle=False, verbose=0)
    return float(np.abs(weights(mine) - weights(ref)).max())
