"""The Spark ML estimators' cases of tests/workers/spark_driver.py (ringreduce.spark.torch):
fits on 2 ranks in the driver's Spark application, with the store in a fresh directory
that every executor sees (the namespace hosts share this machine's file system)."""

from __future__ import annotations

import os
import tempfile

import numpy as np

COEF = np.array([1.0, -2.0, 0.5])


def frame(spark, n=240):
    """Rows of (features vector, y, y2 array, weight, is_val): y linear in the features."""
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3))
    y = x @ COEF + 0.3
    rows = [(Vectors.dense(xi), float(t), [float(t), float(-t)], float(1 + i % 3),
             i % 5 == 0) for i, (xi, t) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, ["features", "y", "y2", "w", "is_val"])


def replay(store, run_id, start, epochs, steps, batch, lr):
    """Plain float64 SGD on the parts each rank was given (the same assignment the fit
    made), the two ranks' gradients averaged per step, in order (shuffle=False)."""
    from ringreduce.spark._estimator import RankData, assign

    path = store.get_train_data_path(run_id)
    parts = sorted((os.path.join(path, f), int(np.load(os.path.join(path, f))["y"].shape[0]))
                   for f in os.listdir(path))
    ranks = [RankData(paths) for paths in assign(parts, 2, "replay")]
    w, b = np.array(start[0], np.float64).reshape(-1), float(np.asarray(start[1]).reshape(-1)[0])
    for epoch in range(epochs):
        for batches in zip(*(r.batches(epoch, steps, batch, False, 0) for r in ranks)):
            gw, gb = np.zeros(3), 0.0
            for data in batches:
                err = data["features"] @ w + b - data["y"]
                gw += 2 * data["features"].T @ err / len(err) / 2
                gb += 2 * err.mean() / 2
            w, b = w - lr * gw, b - lr * gb
    return np.concatenate([w, [b]])


def torch_estimator(spark):
    """Fit (validation by a column, no shuffling), the replay, a resumed fit and transform."""
    import torch

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.torch import TorchEstimator

    df = frame(spark)
    store = Store.create(tempfile.mkdtemp(prefix="rr-est-"))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    start = [p.detach().numpy().copy() for p in model.parameters()]
    est = TorchEstimator(num_proc=2, store=store, model=model, run_id="lin",
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss,  # (N, 1) outputs, (N,) labels
                         feature_cols=["features"], label_cols=["y"], validation="is_val",
                         batch_size=8, epochs=3, shuffle=False, partitions_per_process=3,
                         verbose=0)
    fitted = est.fit(df)
    got = weights(fitted)
    want = replay(store, "lin", start, 3, 192 // 16, 8, 0.05)
    first = fitted.getHistory()
    written = part_times(store, "lin")
    resumed_model = est.setEpochs(5).fit(df)  # the same DataFrame: its parts are reused
    resumed = resumed_model.getHistory()
    resumed_diff = float(np.abs(weights(resumed_model) - replay(
        store, "lin", start, 5, 192 // 16, 8, 0.05)).max())
    reused = part_times(store, "lin") == written
    # two batches of 4 accumulated per step: the same steps as batches of 8
    halves = est.copy().setRunId("halves").setBatchSize(4).setBackwardPassesPerStep(2)
    got_halves = np.concatenate([p.detach().numpy().reshape(-1) for p in
                                 halves.setEpochs(1).fit(df).getModel().parameters()])
    want_halves = replay(store, "halves", start, 1, 192 // 16, 8, 0.05)
    other = torch.nn.Linear(3, 2)  # run "lin"'s checkpoint is of another model
    mismatch = refusal(est.copy().setModel(other).setOptimizer(
        torch.optim.SGD(other.parameters(), lr=0.1)).setEpochs(6), df)
    out = fitted.transform(df)
    rows = out.select("features", "y", "y__output").collect()
    local = fitted.getModel()(torch.tensor(np.array([r["features"].toArray() for r in rows]),
                                           dtype=torch.float32)).detach().numpy().reshape(-1)
    return {"history": first, "resumed": resumed, "replay_diff": float(np.abs(got - want).max()),
            "coef": got.tolist(), "columns": out.columns, "rows": len(rows),
            "saved": saved_and_loaded(fitted, df, "y__output"),
            "transform_diff": float(np.abs(local - [r["y__output"] for r in rows]).max()),
            "checkpoint": sorted(os.listdir(store.get_run_path("lin"))),
            "halves_diff": float(np.abs(got_halves - want_halves).max()), "mismatch": mismatch,
            "resumed_diff": resumed_diff, "reused": reused}


def part_times(store, run_id):
    """The run's training parts and the nanosecond they were written."""
    path = store.get_train_data_path(run_id)
    return {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in sorted(os.listdir(path))}


def weights(fitted):
    return np.concatenate([p.detach().numpy().reshape(-1) for p in fitted.getModel().parameters()])


def lit_module():
    """A LightningModule: Linear(3, 1), SGD(0.05), mse; batches are dicts by column."""
    import lightning.pytorch as pl
    import torch

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x)

        def _loss(self, batch):
            return torch.nn.functional.mse_loss(self(batch["features"]).reshape(-1),
                                                batch["y"])

        def training_step(self, batch, idx):
            loss = self._loss(batch)
            self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
            return loss

        def validation_step(self, batch, idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def on_train_epoch_end(self):  # the module's hook runs after the callbacks' own
            self.log("epoch_end", float(self.current_epoch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Lit()


def lightning_estimator(spark):
    """The Lightning estimator: the replay (the same parts and steps as torch_estimator's),
    a resume with a ModelCheckpoint, transform, save/load, refusals."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.lightning import TorchEstimator

    df = frame(spark)
    store = Store.create(tempfile.mkdtemp(prefix="rr-lit-"))
    model = lit_module()
    start = [p.detach().numpy().copy() for p in model.parameters()]
    est = TorchEstimator(num_proc=2, store=store, model=model, run_id="lit",
                         feature_cols=["features"], label_cols=["y"], validation="is_val",
                         batch_size=8, epochs=3, shuffle=False, partitions_per_process=3,
                         verbose=0)
    fitted = est.fit(df)
    got = weights(fitted)
    # now: a later fit of this run_id writes the run's data again (partitioned anew)
    want = replay(store, "lit", start, 3, 192 // 16, 8, 0.05)
    first = fitted.getHistory()
    resumed = est.copy().setEpochs(5).setCallbacks(
        [ModelCheckpoint(monitor="val_loss", filename="best")]).fit(df)
    rows = fitted.transform(df).select("features", "y__output").collect()
    local = fitted.getModel()(torch.tensor(np.array([r["features"].toArray() for r in rows]),
                                           dtype=torch.float32)).detach().numpy().reshape(-1)
    return {"replay_diff": float(np.abs(got - want).max()),
            "history": first, "resumed": resumed.getHistory(),
            "best": sorted(os.listdir(os.path.join(store.get_run_path("lit"), "lightning"))),
            "transform_diff": float(np.abs(local - [r["y__output"] for r in rows]).max()),
            "saved": saved_and_loaded(fitted, df, "y__output"),
            "plain": refusal(est.copy().setModel(torch.nn.Linear(3, 1)), df),
            "mismatch": refusal(_other_lit(est), df),
            "foreign": refusal(_foreign_run(est, store), df)}


def _foreign_run(est, store):
    """The estimator on a run whose checkpoint is a TorchEstimator's (no Lightning one)."""
    import pickle

    path = store.get_checkpoint_path("foreign")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"model": {}, "optimizer": {}, "history": {"loss": [1.0]}}, f)
    return est.copy().setRunId("foreign")


def _other_lit(est):
    """The estimator with a module of another shape, on run "lit" (which has a checkpoint)."""
    import torch

    other = lit_module()
    other.lin = torch.nn.Linear(3, 2)
    return est.copy().setModel(other).setEpochs(6)


def saved_and_loaded(fitted, df, column):
    """Spark ML persistence: the model saved and loaded alone and in a PipelineModel;
    the largest difference of their predictions from the fitted model's, and the class."""
    from pyspark.ml import PipelineModel

    where = tempfile.mkdtemp(prefix="rr-saved-")
    fitted.write().overwrite().save(os.path.join(where, "model"))
    alone = type(fitted).load(os.path.join(where, "model"))
    PipelineModel([fitted]).write().save(os.path.join(where, "pipeline"))
    piped = PipelineModel.load(os.path.join(where, "pipeline"))

    def predictions(m):
        return np.array([r[column] for r in m.transform(df).select(column).collect()])

    want = predictions(fitted)
    return {"diff": max(float(np.abs(predictions(m) - want).max()) for m in (alone, piped)),
            "class": type(piped.stages[0]).__name__, "uid": alone.uid == fitted.uid,
            "history": alone.getHistory() == fitted.getHistory()}


def refusal(est, df):
    """The error a fit raises, as ``[class name, message]``."""
    try:
        est.fit(df)
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None


def no_step(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
    """A train_minibatch_fn's step that computes the loss and changes nothing."""
    outputs, labels = transform_outputs(model(*inputs), labels)
    return outputs, loss_fn(outputs, labels, sample_weights)


def torch_estimator_vector(spark):
    """An array label (a vector output column), sample weights and a validation fraction;
    refusals (a missing column, more ranks than rows, nulls, ragged vectors); a custom
    step and null validation flags."""
    import torch

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.torch import TorchEstimator

    df = frame(spark)
    model = torch.nn.Linear(3, 2)

    def weighted(output, label):
        return ((output - label) ** 2).mean(dim=1)

    est = TorchEstimator(num_proc=2, store=Store.create(tempfile.mkdtemp(prefix="rr-est-")),
                         model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                         loss=weighted, feature_cols=["features"], label_cols=["y2"],
                         sample_weight_col="w", validation=0.25, batch_size=16, epochs=2,
                         random_seed=3, partitions_per_process=2, verbose=0)
    fitted = est.fit(df)
    first = fitted.transform(df).select("y2__output").first()[0]
    out = {"history": fitted.getHistory(), "output_type": type(first).__name__,
           "output_size": len(first)}
    from pyspark.sql import functions as F

    out["missing"] = refusal(est.copy().setFeatureCols(["nope"]), df)
    out["too_few_rows"] = refusal(est.copy().setValidation(None), df.limit(1))
    thirds = F.col("w") == 2.0
    out["nulls"] = refusal(est, df.withColumn("y2", F.when(thirds, None).otherwise(F.col("y2"))))
    out["lengths"] = refusal(est, df.withColumn("y2", F.when(thirds, F.array(F.col("y")))
                                                .otherwise(F.col("y2"))))
    # One more fit for two things. Horovod's custom step: one that never steps leaves the
    # weights where they started. A null validation flag trains: of 240 rows a fifth are
    # flagged, and a third of the rest have a null flag.
    flags = df.withColumn("is_val", F.when(thirds & ~F.col("is_val"), None)
                          .otherwise(F.col("is_val")))
    start = [t.detach().numpy().copy() for t in model.parameters()]
    frozen = (est.copy().setTrainMinibatchFn(lambda: no_step).setEpochs(1)
              .setValidation("is_val").setRunId("flags").fit(flags))
    out["custom_step_moved"] = max(float(np.abs(a - t.detach().numpy()).max()) for a, t in
                                   zip(start, frozen.getModel().parameters()))
    out["custom_step_loss"] = frozen.getHistory()["loss"]
    store = est.getStore()
    out["null_flag_rows"] = [sum(int(np.load(os.path.join(d, f))["w"].shape[0])
                                 for f in os.listdir(d))
                             for d in (store.get_train_data_path("flags"),
                                       store.get_val_data_path("flags"))]
    return out


def keras_estimator(spark):
    """As torch_estimator, for KerasEstimator on the TensorFlow backend, with a metric."""
    import keras

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.keras import KerasEstimator

    df = frame(spark)
    store = Store.create(tempfile.mkdtemp(prefix="rr-est-"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    start = [np.array(w) for w in model.get_weights()]
    est = KerasEstimator(num_proc=2, store=store, model=model, run_id="lin",
                         optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                         feature_cols=["features"], label_cols=["y"], validation="is_val",
                         batch_size=8, epochs=3, shuffle=False, partitions_per_process=3,
                         verbose=0, custom_objects={"unused": lambda x: x})  # saves too
    fitted = est.fit(df)
    got = np.concatenate([np.ravel(w) for w in fitted.getModel().get_weights()])
    # mode="max" keeps the worst epoch (the first: the loss falls) as "best": the model
    # returned must be that file's, not the last epoch's
    from ringreduce.keras.callbacks import BestModelCheckpoint

    halves = est.copy().setRunId("halves").setBatchSize(4).setBackwardPassesPerStep(2) \
        .setCheckpointCallback(BestModelCheckpoint(monitor="val_loss", mode="max"))
    halves_fit = halves.setEpochs(2).fit(df)
    got_halves = np.concatenate([np.ravel(w) for w in halves_fit.getModel().get_weights()])
    worst = int(np.argmax(halves_fit.getHistory()["val_loss"]))
    want_halves = replay(store, "halves", start, worst + 1, 192 // 16, 8, 0.05)
    last_halves = replay(store, "halves", start, 2, 192 // 16, 8, 0.05)
    want = replay(store, "lin", start, 3, 192 // 16, 8, 0.05)
    first = fitted.getHistory()
    resumed = est.setEpochs(5).fit(df).getHistory()
    rows = fitted.transform(df).select("features", "y__output").collect()
    local = fitted.getModel().predict_on_batch(
        np.array([r["features"].toArray() for r in rows], np.float32)).reshape(-1)
    return {"history": first, "resumed": resumed, "replay_diff": float(np.abs(got - want).max()),
            "rows": len(rows), "saved": saved_and_loaded(fitted, df, "y__output"),
            "halves_diff": float(np.abs(got_halves - want_halves).max()),
            "halves_worst": worst,
            "halves_last_diff": float(np.abs(got_halves - last_halves).max()),
            "transform_diff": float(np.abs(local - [r["y__output"] for r in rows]).max())}
