"""Keras 3 (TensorFlow, torch or JAX backend: KERAS_BACKEND) in real processes: fit equivalence,
callbacks, load_model, faults.

    RINGREDUCE_RANK=r RINGREDUCE_SIZE=2 ... python keras_worker.py DIR   (r = 0, 1)

np=2 with half batches ends with the weights of one process training on the full batches
(SGD and Adam, float64, also with backward_passes_per_step=2, and on the tensorflow
backend with an Embedding: IndexedSlices gradients), metrics are averaged, the warmup
schedule is Horovod's, the checkpoint callback writes on rank 0 only and load_model
resumes every rank. Last (one process per backend and rank does it all: Keras imports
are slow), rank 1 exits inside model.fit, and rank 0 must raise PeerLostError from fit
within seconds (logged as an event). The env-var launch, since mpirun would kill rank 0
as soon as rank 1 exits.
"""

from __future__ import annotations

import os
import sys
import time

import keras
import numpy as np
from workerlib import error_event, event, run, say, set_rank

import ringreduce.keras as rr

keras.backend.set_floatx("float64")
RNG = np.random.default_rng(0)
X, Y = RNG.normal(size=(32, 5)), RNG.normal(size=(32, 1))
IDS = RNG.integers(0, 8, size=(32, 2))  # the embedding model's inputs


def make_model(embedding: bool = False) -> keras.Model:
    keras.utils.set_random_seed(1234)
    if embedding:  # its gradient is a tf.IndexedSlices on the tensorflow backend
        return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(8, 3),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def weights(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.ravel(keras.ops.convert_to_numpy(v)) for v in model.weights])


def batches(per_rank: int, xs: np.ndarray = X) -> tuple:
    """Rank r's rows, and the same rows in the order one process sees them at batch n*B."""
    n, r = rr.size(), rr.rank()
    steps = len(X) // (per_rank * n)
    mine = np.concatenate([np.arange((s * n + r) * per_rank, (s * n + r + 1) * per_rank)
                           for s in range(steps)])
    return xs[mine], Y[mine]


def engine_tensors() -> int:
    """Tensors the engine has reduced, broadcast or gathered so far on this rank."""
    import ringreduce

    return ringreduce._comm()._engine.stats()["tensors"]


def equivalence(opt_name: str, passes: int, keras_steps: int = 0,
                embedding: bool = False) -> None:
    """fit at np=n equals one process on batches of n x per_rank x k, k = passes (ours) or
    keras_steps (the Keras optimizer's own gradient_accumulation_steps, set by the user);
    ``embedding``: the model with an Embedding layer."""
    acc = {"gradient_accumulation_steps": keras_steps} if keras_steps else {}
    make_opt = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.5, **acc),
                "adam": lambda: keras.optimizers.Adam(0.01, **acc)}[opt_name]
    per_rank = 4
    model = make_model(embedding)
    first = model.layers[0].weights[0]
    if rr.rank() == 1:  # different start: the broadcast callback must fix it
        first.assign(np.zeros(first.shape))
    opt = rr.DistributedOptimizer(make_opt(), backward_passes_per_step=passes,
                                  average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    inputs = IDS if embedding else X
    xs, ys = batches(per_rank, inputs)
    before = engine_tensors()
    model.fit(xs, ys, batch_size=per_rank, epochs=2, shuffle=False, verbose=0,
              callbacks=[rr.callbacks.BroadcastGlobalVariablesCallback(0)])
    reduced = engine_tensors() - before
    ref = make_model(embedding)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5) if keras_steps else make_opt(),
                loss="mse")
    ref.fit(inputs, Y, batch_size=per_rank * rr.size() * max(passes, keras_steps), epochs=2,
            shuffle=False, verbose=0)
    diff = float(np.abs(weights(model) - weights(ref)).max())
    event("equivalence", opt=opt_name, passes=passes, keras_steps=keras_steps,
          embedding=embedding, diff=diff,
          tensors=reduced,
          iterations=int(keras.ops.convert_to_numpy(opt.iterations)),
          ref_iterations=int(keras.ops.convert_to_numpy(ref.optimizer.iterations)))
    # Keras's torch backend computes something of the loss in float32 even with floatx
    # float64: one process on batches of 8 and the mean of two halves already differ by
    # 1.7e-8 without ringreduce (measured at -np 1 with backward_passes_per_step=2).
    if diff > (1e-10 if keras.backend.backend() == "tensorflow" else 1e-7):
        raise AssertionError(f"{opt_name} k={passes}: weights differ from one process by {diff}")


def accumulation_refusals() -> None:
    """jax: backward_passes_per_step becomes Keras's gradient_accumulation_steps, so it
    cannot be given twice, nor to an optimizer that was built without accumulators."""
    for opt, match in [(keras.optimizers.SGD(0.1, gradient_accumulation_steps=3), "not both"),
                       (keras.optimizers.SGD(0.1), "has not been built yet")]:
        if match.startswith("has"):
            opt.build(make_model().trainable_variables)
        try:
            rr.DistributedOptimizer(opt, backward_passes_per_step=2)
        except rr.InvalidInputError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"not refused: {match}")
    event("accumulation-refusals", ok=True)


def loss_scaling() -> None:
    """A LossScaleOptimizer skips a step whose gradients are not finite; its check must see
    the averaged gradients. Two ways in: compile() under mixed_float16 wrapping the
    DistributedOptimizer (the averaging moves out to its LossScaleOptimizer), and the user
    wrapping a LossScaleOptimizer (Horovod's recipe; on jax its stateless_apply bypassed
    apply). Rank 1's first batch overflows float16: every rank skips that step and halves
    its scale, and the ranks end with the same weights and scale. compile() twice with one
    DistributedOptimizer: it still averages (through the second LossScaleOptimizer)."""
    import ringreduce
    from ringreduce.keras.optimizer import is_distributed

    per_rank = 4
    xs, ys = batches(per_rank)
    if rr.rank() == 1:
        xs = xs.copy()
        xs[:per_rank] *= 1e6  # inf in float16
    for how in ("compile", "user"):
        keras.config.set_dtype_policy("mixed_float16")
        try:
            model = make_model()
        finally:
            keras.config.set_dtype_policy("float64")
        if how == "compile":
            opt = rr.DistributedOptimizer(keras.optimizers.SGD(0.01))
        else:
            opt = rr.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.01), initial_scale=2.0 ** 4))
        model.compile(optimizer=opt, loss="mse")
        if how == "compile":  # again: the same DistributedOptimizer, a new LossScaleOptimizer
            model.compile(optimizer=opt, loss="mse")
        lso = model.optimizer
        assert isinstance(lso, keras.optimizers.LossScaleOptimizer), type(lso)
        assert is_distributed(lso) and is_distributed(opt)
        before = engine_tensors()
        model.fit(xs, ys, batch_size=per_rank, epochs=2, shuffle=False, verbose=0,
                  callbacks=[rr.callbacks.BroadcastGlobalVariablesCallback(0)])
        reduced = engine_tensors() - before
        scale = float(keras.ops.convert_to_numpy(lso.dynamic_scale))
        mine = np.concatenate([weights(model), [scale]]).astype(np.float64)
        every = ringreduce.allgather(mine[None], name=f"loss-scaling.{how}")
        spread = float(np.abs(every - every[0]).max())
        event("loss-scaling", how=how, scale=scale, spread=spread, tensors=reduced,
              initial=float(lso.initial_scale))
        assert spread == 0.0 and reduced > 0 and scale < lso.initial_scale, (how, spread, scale)


def lazily_built() -> None:
    """A model without an Input (Horovod's examples) is built by Keras on its first batch:
    BroadcastGlobalVariablesCallback must then broadcast after that batch (Horovod's timing)
    rather than build the optimizer for no variables. Ranks end equal; started equal, they
    end with one process's weights."""
    def make(seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.layers.Dense(4, activation="tanh"),
                                 keras.layers.Dense(1)])

    per_rank = 4
    xs, ys = batches(per_rank)
    spread, final = {}, {}
    for start in ("same", "different"):
        model = make(1234 if start == "same" else 1234 + rr.rank())
        model.compile(optimizer=rr.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        model.fit(xs, ys, batch_size=per_rank, epochs=2, shuffle=False, verbose=0,
                  callbacks=[rr.callbacks.BroadcastGlobalVariablesCallback(0)])
        final[start] = weights(model)
        spread[start] = max(float(np.abs(w - final[start]).max())
                            for w in rr.allgather_object(final[start]))
    ref = make(1234)
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ref.fit(X, Y, batch_size=per_rank * rr.size(), epochs=2, shuffle=False, verbose=0)
    event("lazy", spread=spread, diff=float(np.abs(final["same"] - weights(ref)).max()))


class Record(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.lrs: list = []
        self.logs: list = []
        self.weights: list = []

    def on_train_batch_begin(self, batch: int, logs: dict = None) -> None:
        self.lrs.append(float(self.model.optimizer.learning_rate))

    def on_epoch_end(self, epoch: int, logs: dict = None) -> None:
        self.logs.append(dict(logs or {}))
        self.weights.append(weights(self.model))


def callbacks_and_checkpoints(directory: str) -> None:
    model = make_model()
    model.compile(optimizer=rr.DistributedOptimizer(keras.optimizers.SGD(0.08)), loss="mse",
                  metrics=["mae"])
    record = Record()
    path = os.path.join(directory, "ckpt.keras")
    xs, ys = X[rr.rank() * 8:(rr.rank() + 1) * 8], Y[rr.rank() * 8:(rr.rank() + 1) * 8] * (
        1 + rr.rank())
    model.fit(xs, ys, batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=[rr.callbacks.BroadcastGlobalVariablesCallback(0),
                         rr.callbacks.MetricAverageCallback(),
                         rr.callbacks.LearningRateWarmupCallback(initial_lr=0.08,
                                                                 warmup_epochs=2),
                         record, rr.callbacks.ModelCheckpoint(path)])
    event("callbacks", lrs=record.lrs, logs=record.logs)
    rr.barrier()
    loaded = rr.load_model(path)
    same = bool(np.array_equal(weights(loaded), weights(model)))
    event("loaded", same=same, distributed=type(loaded.optimizer).__mro__[1].__name__,
          backend=keras.backend.backend(),
          files=sorted(os.listdir(directory)))
    if not same:
        raise AssertionError("load_model returned other weights")
    # A legacy .h5 path gets HDF5, not Keras's zip under that name, and loads back (without
    # its compile config: Keras's HDF5 loader cannot rebuild a "mse" string loss).
    h5 = os.path.join(directory + "-h5", "model.h5")  # beside: the listing above stays
    os.makedirs(os.path.dirname(h5), exist_ok=True)
    rr.save_model(model, h5)
    rr.barrier()
    with open(h5, "rb") as f:
        magic = f.read(4)
    back = keras.models.load_model(h5, compile=False)
    event("h5", magic=magic.hex(), same=bool(np.array_equal(weights(back), weights(model))))
    schedule = Record()
    # BestModelCheckpoint with mode="max" keeps the epoch of the highest mean loss
    best = os.path.join(directory + "-best", "best.weights.h5")
    model.fit(xs, ys, batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=[rr.callbacks.LearningRateScheduleCallback(
                  initial_lr=0.08, multiplier=0.5, start_epoch=1),  # 0.5 ** (epoch - 1)
                  rr.callbacks.MetricAverageCallback(), schedule,
                  rr.callbacks.BestModelCheckpoint(monitor="loss", mode="max", filepath=best,
                                                   save_weights_only=True)])
    event("schedule", lrs=schedule.lrs)
    rr.barrier()
    worst = int(np.argmax([logs["loss"] for logs in schedule.logs]))
    kept = None
    if os.path.exists(best):
        model.load_weights(best)
        kept = float(np.abs(weights(model) - schedule.weights[worst]).max())
    event("best", worst=worst, kept=kept, files=sorted(os.listdir(os.path.dirname(best)))
          if os.path.isdir(os.path.dirname(best)) else None)
    try:
        model.fit(xs, ys, epochs=1, verbose=0, callbacks=[rr.callbacks.BestModelCheckpoint()])
    except rr.InvalidInputError as e:
        event("best-no-path", error=str(e))


def sync_batch_norm() -> None:
    """SyncBatchNormalization: the layer cases of sync_bn_cases (unequal per-rank batches;
    in tf.function on tensorflow; on jax only the masked one, not jitted: JAX's per-op
    dispatch under jax.grad made the three cases cost 14 s, and fit runs the layer jitted)
    at this size and at size 1 (on rank 0), and model.fit with it."""
    import sync_bn_cases

    start = time.time()
    backend = keras.backend.backend()
    layer = sync_bn_cases.layer_cases(rr.rank(), rr.size(), rr.allgather_object,
                                      compiled=backend == "tensorflow",
                                      names=["masked-sequence"] if backend == "jax" else None)
    # one process's arithmetic, the same on every rank: rank 0 checks it for both
    single = sync_bn_cases.single_rank_is_batch_norm() if rr.rank() == 0 else None
    fit = sync_bn_cases.fit_equals_one_process(batches, X, Y)
    event("sync-bn", layer=layer, single=single, fit=fit, seconds=time.time() - start)


def die() -> None:
    class Exit(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict = None) -> None:
            if rr.rank() == 1 and batch == 3:
                os._exit(17)

    model = make_model()
    model.compile(optimizer=rr.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    start = time.time()
    try:
        model.fit(np.tile(X, (20, 1)), np.tile(Y, (20, 1)), batch_size=4, epochs=5, verbose=0,
                  callbacks=[rr.callbacks.BroadcastGlobalVariablesCallback(0), Exit()])
    except Exception as err:  # noqa: BLE001 - the class is what is checked
        error_event("fit-error", err)
        event("fit-error-after", seconds=time.time() - start)
        os._exit(3)  # at once, as a job would: the peer is gone
    raise AssertionError("fit finished although rank 1 died")


def main() -> None:
    rr.init()
    set_rank(rr.rank())
    for opt_name in ("sgd", "adam"):
        equivalence(opt_name, 1)
    equivalence("sgd", 2)
    equivalence("sgd", 1, keras_steps=2)
    if keras.backend.backend() == "tensorflow":
        equivalence("sgd", 2, embedding=True)
    if keras.backend.backend() == "jax":
        accumulation_refusals()
    loss_scaling()
    lazily_built()
    sync_batch_norm()
    callbacks_and_checkpoints(sys.argv[1])
    rr.barrier()
    say(f"OK rank {rr.rank()}")
    die()  # last: it ends the job


if __name__ == "__main__":
    run(main)
