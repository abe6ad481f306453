"""Worker of tests/test_elastic_tensorflow.py, started by ``ringrun --min-np ...``.

``elastic_tf_worker.py keras`` : ``model.fit`` with ringreduce.keras's elastic callbacks;
    the worker on host ``b`` dies (``os._exit(1)``) in epoch 1, at batch 3.
``elastic_tf_worker.py loop FILE`` : a custom loop (DistributedGradientTape) with
    ``TensorFlowKerasState``; rank 0 adds host ``c`` to the discovery FILE in epoch 1.

Each worker appends JSON events to ``$RR_TEST_LOG_DIR/<worker id>.log``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

WID = os.environ.get("RINGREDUCE_ELASTIC_WORKER", "?")
HOST = os.environ.get("RINGREDUCE_HOST_ID", "ringrun:?").split(":", 1)[1]
EPOCHS, STEPS, BATCH = 4, 6, 8


def log(ev: str, **fields: object) -> None:
    line = json.dumps({"ev": ev, "wid": WID, "host": HOST, "t": time.time(), **fields})
    with open(os.path.join(os.environ["RR_TEST_LOG_DIR"], f"{WID}.log"), "a") as f:
        f.write(line + "\n")


def checksum(variables: list) -> str:
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes())
    return h.hexdigest()[:16]


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)  # a different start on every worker: sync must fix it
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]


class Progress(keras.callbacks.Callback):
    """Logs the epochs begun; the worker on host b dies in epoch 1 at batch 3."""

    def __init__(self, hvd: object, state: object) -> None:
        super().__init__()
        self.hvd, self.state = hvd, state

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        opt = self.model.optimizer
        log("epoch", epoch=epoch, size=self.hvd.size(), rank=self.hvd.rank(),
            iterations=int(opt.iterations.numpy()))

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if HOST == "b" and self.state.epoch == 1 and batch == 3:
            log("dying", batch=batch)
            os._exit(1)


def keras_job() -> None:
    import ringreduce.keras as hvd

    hvd.init()
    model = make_model(int(WID[1:]))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), Progress(hvd, state)]
    x, y = data(STEPS * BATCH * 8, int(WID[1:]))

    @hvd.elastic.run
    def train(state: object) -> None:
        log("attempt", size=hvd.size(), rank=hvd.rank(), epoch=state.epoch)
        state.model.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, epochs=EPOCHS,
                        initial_epoch=state.epoch, callbacks=callbacks, verbose=0)

    train(state)
    log("done", epoch=state.epoch, batch=state.batch, rank=hvd.rank(), size=hvd.size(),
        iterations=int(model.optimizer.iterations.numpy()),
        weights=checksum(model.variables + model.optimizer.variables))


def loop_job(discovery: str) -> None:
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
    if sys.argv[1] == "keras":
        keras_job()
    else:
        loop_job(sys.argv[2])
