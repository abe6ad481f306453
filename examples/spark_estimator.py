"""Train a digits classifier on a Spark DataFrame with TorchEstimator (Horovod's Spark ML
estimator API): the DataFrame in, a Spark ML model out, its predictions as a column::

    python examples/spark_estimator.py --num-proc 2                 # Spark on this machine
    python examples/spark_estimator.py --num-proc 2 --epochs 20 --run-id digits-1
    spark-submit --master spark://head:7077 examples/spark_estimator.py --num-proc 8 \\
        --store /shared/ringreduce-store

The store must be a directory that the driver and every executor see at the same path.
A second run with the same ``--run-id`` and more ``--epochs`` resumes from the first's
checkpoint. The ranks' output comes back here, prefixed ``[rank]: ``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Optional


def accuracy(output, label):
    """The share of rows whose largest logit is the label (a metric of the history)."""
    return (output.argmax(dim=1) == label).float().mean()


def cross_entropy(output, label):
    import torch

    return torch.nn.functional.cross_entropy(output, label)


def frames(spark):
    """The digits as two DataFrames (train, test) of a 64-value vector and an int label,
    cached: the fit reads one twice, and a DataFrame made from Python rows is otherwise
    recomputed by Python workers, which PySpark's daemon reports with a harmless
    BrokenPipeError whenever Spark stops one early (``limit``)."""
    from _digits import digits_split  # here: the executors import this module without it
    from pyspark.ml.linalg import Vectors

    x_train, x_test, y_train, y_test = digits_split(images=False)
    return [spark.createDataFrame([(Vectors.dense(xi), int(yi)) for xi, yi in zip(x, y)],
                                  ["features", "label"]).cache()
            for x, y in ((x_train, y_train), (x_test, y_test))]


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Fit on ``--num-proc`` ranks, predict the test rows; the history and test accuracy."""
    import numpy as np
    import torch
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    from ringreduce.spark.common.store import Store
    from ringreduce.spark.torch import TorchEstimator

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-proc", type=int, default=2, help="ranks, one Spark task each")
    p.add_argument("--master", help="Spark master (default: spark-submit's, else "
                                    "local[<num-proc>] on this machine)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--store", default=os.path.abspath("spark_store"))
    p.add_argument("--run-id", default=None, help="resume this run if it has a checkpoint")
    args = p.parse_args(argv)
    builder = SparkSession.builder.appName("ringreduce-estimator-example")
    if args.master or not SparkConf().contains("spark.master"):
        builder = builder.master(args.master or f"local[{args.num_proc}]")
    owned = SparkSession.getActiveSession() is None  # else a notebook's or a test's session
    spark = builder.getOrCreate()
    spark.sparkContext.addPyFile(os.path.abspath(__file__))  # the loss and the metric
    train, test = frames(spark)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    est = TorchEstimator(num_proc=args.num_proc, store=Store.create(args.store), model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=args.lr,
                                                   momentum=0.9),
                         loss=cross_entropy, metrics=[accuracy], feature_cols=["features"],
                         label_cols=["label"], validation=0.1, batch_size=args.batch_size,
                         epochs=args.epochs, random_seed=1, run_id=args.run_id)
    fitted = est.fit(train)
    rows = fitted.transform(test).select("label", "label__output").collect()
    hits = np.mean([np.argmax(r["label__output"].toArray()) == r["label"] for r in rows])
    history = fitted.getHistory()
    print(f"validation accuracy {history['val_accuracy'][-1]:.3f} after "
          f"{len(history['loss'])} epochs; test accuracy {hits:.3f}")
    if owned:
        spark.stop()
    return {"history": history, "test_accuracy": float(hits)}


if __name__ == "__main__":
    main()
