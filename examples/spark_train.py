"""Train examples/pytorch_train.py's model on Spark with ringreduce.spark.run.

The training function is the mpirun example's own ``main``; Spark runs it as ``--num-proc``
ranks, one barrier task each, and returns every rank's final test accuracy::

    python examples/spark_train.py --num-proc 2                  # Spark on this machine
    python examples/spark_train.py --num-proc 2 --epochs 3 --lr 0.1   # flags of pytorch_train
    spark-submit --master spark://head:7077 examples/spark_train.py --num-proc 8

Flags this script does not know go to ``pytorch_train.py`` (``--epochs``, ``--lr``,
``--checkpoint-dir``, ...). The ranks' output comes back here, prefixed ``[rank]: ``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import ringreduce.spark

HERE = Path(__file__).resolve().parent


def main(argv: Optional[Sequence[str]] = None) -> list:
    """Start (or join) a Spark session, train on ``--num-proc`` ranks; every rank's
    final test accuracy, in rank order."""
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-proc", type=int, default=2, help="ranks, one Spark task each")
    p.add_argument("--master", help="Spark master (default: spark-submit's, else "
                                    "local[<num-proc>] on this machine)")
    args, train_argv = p.parse_known_args(argv)
    builder = SparkSession.builder.appName("ringreduce-spark-example")
    if args.master or not SparkConf().contains("spark.master"):
        builder = builder.master(args.master or f"local[{args.num_proc}]")
    spark = builder.getOrCreate()
    # The executors import the training module as this driver does.
    spark.sparkContext.addPyFile(str(HERE / "pytorch_train.py"))
    import pytorch_train

    if not any(a.startswith("--checkpoint-dir") for a in train_argv):
        train_argv += ["--checkpoint-dir", os.path.abspath("checkpoints")]
    accuracies = ringreduce.spark.run(pytorch_train.main, args=(train_argv,),
                                      num_proc=args.num_proc)
    print(f"test accuracy on each of the {len(accuracies)} ranks: "
          + ", ".join(f"{a:.3f}" for a in accuracies))
    return accuracies


if __name__ == "__main__":
    main()
