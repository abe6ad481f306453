"""Worker of tests/test_elastic_keras.py and tests/test_elastic_tensorflow.py.

``elastic_tf_worker.py keras BACKEND`` : ``model.fit`` with ringreduce.keras's elastic
    callbacks on Keras's BACKEND (tensorflow, torch or jax), under ``ringrun``; commits
    every 3 batches and at epoch ends; the worker on host ``b`` dies (``os._exit(1)``) in
    epoch 1 after batch 4, so the survivors lose batches 3 and 4 of it. Each rank trains
    on its rank's data (``data(rank)``, unshuffled), so the result depends only on which
    sizes ran which steps; rank 0 logs the starting and final weights.
``elastic_tf_worker.py check BACKEND`` : ``KerasState`` and the callbacks in one process
    (no launcher): save, restore, sync, an unbuilt optimizer, a commit in the middle of an
    epoch and a ``fit`` that fails after it; prints ``CHECKS OK``.
``elastic_tf_worker.py loop FILE`` : a custom TensorFlow loop (DistributedGradientTape)
    with ``TensorFlowKerasState``; rank 0 adds host ``c`` to the discovery FILE in epoch 1.

The backend is set before keras is imported (Keras picks it once). Each launched worker
appends JSON events to ``$RR_TEST_LOG_DIR/<worker id>.log``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if sys.argv[1] in ("keras", "check"):
    os.environ["KERAS_BACKEND"] = sys.argv[2]
import keras  # noqa: E402

WID = os.environ.get("RINGREDUCE_ELASTIC_WORKER", "?")
HOST = os.environ.get("RINGREDUCE_HOST_ID", "ringrun:?").split(":", 1)[1]
EPOCHS, STEPS, BATCH = 4, 6, 8
COMMIT_EVERY, DIE_AFTER = 3, 4  # batches; host b dies after batch DIE_AFTER of epoch 1


def log(ev: str, **fields: object) -> None:
    line = json.dumps({"ev": ev, "wid": WID, "host": HOST, "t": time.time(), **fields})
    with open(os.path.join(os.environ["RR_TEST_LOG_DIR"], f"{WID}.log"), "a") as f:
        f.write(line + "\n")


def numpy(variables: list) -> list[np.ndarray]:
    """Copies of Keras variables' values (any backend)."""
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def checksum(variables: list) -> str:
    h = hashlib.sha256()
    for a in numpy(variables):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)  # a different start on every worker: sync must fix it
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]


def iterations(model: keras.Model) -> int:
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class Progress(keras.callbacks.Callback):
    """Logs the epochs begun; the worker on host b dies in epoch 1 after batch DIE_AFTER."""

    def __init__(self, hvd: object, state: object) -> None:
        super().__init__()
        self.hvd, self.state = hvd, state

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        log("epoch", epoch=epoch, size=self.hvd.size(), rank=self.hvd.rank(),
            iterations=iterations(self.model))

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if HOST == "b" and self.state.epoch == 1 and batch == DIE_AFTER:
            log("dying", batch=batch)
            os._exit(1)


def keras_job() -> None:
    import ringreduce.keras as hvd

    hvd.init()
    model = make_model(int(WID[1:]))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), Progress(hvd, state)]

    @hvd.elastic.run
    def train(state: object) -> None:
        log("attempt", size=hvd.size(), rank=hvd.rank(), epoch=state.epoch, batch=state.batch,
            iterations=iterations(model))
        if hvd.rank() == 0 and iterations(model) == 0:  # rank 0's weights, after sync
            log("start", weights=[a.tolist() for a in numpy(model.trainable_variables)])
        x, y = data(STEPS * BATCH, hvd.rank())  # by rank, which a reset may change
        state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, initial_epoch=state.epoch,
                        shuffle=False, callbacks=callbacks, verbose=0)

    train(state)
    log("done", epoch=state.epoch, batch=state.batch, rank=hvd.rank(), size=hvd.size(),
        iterations=iterations(model), backend=keras.backend.backend(),
        weights=checksum(model.variables + model.optimizer.variables),
        values=[a.tolist() for a in numpy(model.trainable_variables)])


class Fail(keras.callbacks.Callback):
    """Raises (as a lost peer would) after batch ``batch`` of epoch ``epoch``."""

    def __init__(self, state: object, epoch: int, batch: int) -> None:
        super().__init__()
        self.state, self.at = state, (epoch, batch)

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if (self.state.epoch, batch) == self.at:
            raise RuntimeError("lost a peer (test)")


def check_save_restore_sync(hvd: object) -> None:
    """Horovod's ``KerasState(model, optimizer)``: the optimizer, not built yet (as on a
    worker that just joined), is built at once; restore brings back every variable."""
    model = make_model(1)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1))
    model.compile(optimizer=opt, loss="mse")
    assert not opt.built
    state = hvd.elastic.KerasState(model, opt, batch=0, epoch=0)
    assert opt.built and len(opt.variables) > 1, opt.variables
    state.epoch = 3
    state.commit()
    saved = numpy(model.variables + opt.variables)
    model.fit(*data(2 * BATCH, 0), batch_size=BATCH, verbose=0)
    assert iterations(model) == 2
    state.epoch = 5
    state.restore()
    assert state.epoch == 3 and iterations(model) == 0
    for a, b in zip(saved, numpy(model.variables + opt.variables), strict=True):
        np.testing.assert_array_equal(a, b)
    state.sync()  # one rank: rank 0's values are its own
    assert state.epoch == 3 and checksum(model.variables + opt.variables) == checksum(saved)


def check_failed_fit_rolls_back(hvd: object) -> None:
    """Commits between batches (on JAX the trainer holds the values then), a ``fit`` that
    fails after one, ``restore`` and ``run``: the same weights as a plain run of the
    batches that were kept."""
    x, y = data(4 * BATCH, 0)
    model = make_model(2)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]
    try:  # the last commit: before batch 2 of epoch 1, after 6 steps
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[*callbacks, Fail(state, 1, 2)])
        raise AssertionError("fit did not fail")
    except RuntimeError as err:
        assert "lost a peer" in str(err), err
    state.restore()
    assert (state.epoch, state.batch, iterations(model)) == (1, 2, 6)

    @hvd.elastic.run
    def train(state: object) -> None:  # outside an elastic job: sync, then once
        model.fit(x, y, batch_size=BATCH, epochs=2, initial_epoch=state.epoch, shuffle=False,
                  verbose=0, callbacks=callbacks)

    train(state)
    assert (state.epoch, state.batch, iterations(model)) == (2, 0, 10)
    twin = make_model(2)  # the batches kept: epoch 0, two of epoch 1, then epoch 1 again
    twin.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for n in (4, 2, 4):
        twin.fit(x[:n * BATCH], y[:n * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(numpy(model.trainable_variables), numpy(twin.trainable_variables),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def check_job() -> None:
    import ringreduce.keras as hvd

    hvd.init()
    try:
        check_save_restore_sync(hvd)
        check_failed_fit_rolls_back(hvd)
    finally:
        hvd.shutdown()
    print("CHECKS OK", keras.backend.backend(), flush=True)


def loop_job(discovery: str) -> None:
    import tensorflow as tf

    import ringreduce.tensorflow as hvd

    hvd.init()
    model = make_model(int(WID[1:]))
    opt = keras.optimizers.Adam(0.01)
    log("before", model=checksum(model.variables), built=bool(opt.built))
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0, step=0)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @hvd.elastic.run
    def train(state: object) -> None:
        log("attempt", size=hvd.size(), rank=hvd.rank(), epoch=state.epoch, step=state.step,
            iterations=int(opt.iterations.numpy()), model=checksum(model.variables),
            weights=checksum(model.variables + opt.variables))
        while state.epoch < EPOCHS:
            if hvd.rank() == 0 and hvd.size() == 2 and state.epoch == 1 and state.step == 0:
                with open(discovery, "w") as f:
                    f.write("a:1\nb:1\nc:1\n")
                log("added_host")
            x, y = data(BATCH, 1000 * state.epoch + 10 * state.step + hvd.rank())
            step(tf.constant(x), tf.constant(y))
            if hvd.size() == 2 and state.epoch >= 1:
                time.sleep(0.5)  # leave the driver time to see the new host
            state.step += 1
            if state.step == STEPS:
                state.epoch, state.step = state.epoch + 1, 0
            state.commit()

    train(state)
    log("done", epoch=state.epoch, rank=hvd.rank(), size=hvd.size(),
        iterations=int(opt.iterations.numpy()), weights=checksum(model.variables + opt.variables))


if __name__ == "__main__":
    {"keras": keras_job, "check": check_job}.get(sys.argv[1], lambda: loop_job(sys.argv[2]))()
